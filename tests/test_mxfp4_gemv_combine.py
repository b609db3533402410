"""The matrix-vector down launch with the combine in it (`Mxfp4MoEConfig.combine_in_down`,
layers/moe/kernels/triton_mxfp4_gemv.py, launch 2') against the same tiles with the combine as
its own launch, and against the torch reference (`GptOssExperts.forward_torch`), under Triton's
CPU interpreter (one spawned child; skipped without triton). MXFP4 weights (scales 2^-4 .. 2^-2),
top-3 (the slots padded to 4 in the launch) and top-4 of 8 experts, 1 to 3 tokens; hidden 160
(5 column tiles of 32, K steps of 64 over intermediate 96: a masked tail).

Tolerances: against the separate combine, rtol = atol = 1e-5 in fp32 (the per-slot sums are the
same; only the order of the k weighted rows' sum differs) and one bf16 rounding (rtol = atol =
1e-2) with bf16 activations; against the reference, the 1e-4 of tests/test_gpt_oss_moe_triton.py
(fp32)."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter
from tests.test_gpt_oss_moe_triton import fill_experts

TILES = dict(block_m=1, block_n_gate_up=32, block_k_gate_up=64, block_n_down=32, block_k_down=64, num_warps=2,
             gemv=True)
CASES = [(1, 3, "float32"), (3, 4, "float32"), (1, 4, "bfloat16"), (2, 3, "bfloat16")]


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import Mxfp4MoEConfig, gpt_oss_experts_triton

    results = {}
    for seed, (tokens, top_k, dtype_name) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        experts = GptOssExperts(8, 160, 96, 1.702, 7.0, True, dtype, None)
        fill_experts(experts, seed)
        g = torch.Generator().manual_seed(200 + seed)
        x = torch.randn(tokens, 160, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
        folded = gpt_oss_experts_triton(x, experts, weights, ids, Mxfp4MoEConfig(**TILES, combine_in_down=True))
        separate = gpt_oss_experts_triton(x, experts, weights, ids, Mxfp4MoEConfig(**TILES))
        results[(tokens, top_k, dtype_name)] = (folded, separate, experts.forward_torch(x, weights, ids))
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "tokens{}-top{}-{}".format(*c))
def test_the_folded_combine_matches_the_separate_one_and_the_reference(interpreted, case):
    folded, separate, reference = interpreted[case]
    assert folded.dtype == separate.dtype and folded.shape == separate.shape == (case[0], 160)
    tolerance = 1e-5 if case[2] == "float32" else 1e-2
    torch.testing.assert_close(folded, separate, rtol=tolerance, atol=tolerance)
    if case[2] == "float32":
        torch.testing.assert_close(folded, reference, rtol=1e-4, atol=1e-4)
