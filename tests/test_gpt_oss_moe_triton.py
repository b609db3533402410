"""gpt-oss's experts in Triton (layers/moe/kernels/triton_mxfp4_moe.py), bf16-form and MXFP4
weights, against the torch reference (`GptOssExperts.forward_torch`) under Triton's CPU
interpreter, fp32 activations (the interpreter's bf16 dots multiply bit patterns; bf16 runs in
tests/gpu/test_gpt_oss_gpu.py). One spawned child with TRITON_INTERPRET=1; skipped without
triton. Routing: random top-4 of 8 experts, some experts without tokens, token counts across
one and several row blocks; weights and biases seeded random, gate/up spread to reach the
SwiGLU's clamps. Tolerance: tests/tolerances.py's fp32."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter
from tests.tolerances import TOLERANCES

RTOL, ATOL = TOLERANCES[torch.float32]
CASES = [(1, False), (5, True), (40, True), (40, False)]  # (tokens, mxfp4)


def fill_experts(experts, seed: int) -> None:
    """Seeded random weights in place: bf16-form weights N(0, 0.5) on gate/up, N(0, 0.1) on down;
    MXFP4 bytes uniform with scales 2^-4 .. 2^-2; biases N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in experts.named_parameters():
        if p.dtype == torch.uint8:
            low, high = (0, 256) if name.endswith("blocks") else (123, 126)
            p.data.copy_(torch.randint(low, high, p.shape, generator=g, dtype=torch.uint8))
        else:
            std = {"w13_weight": 0.5, "w2_weight": 0.1}.get(name, 0.3)
            p.data.copy_(torch.randn(p.shape, generator=g) * std)


def _interpreted(rank: int, world: int) -> dict:
    import triton

    from layers.moe.gpt_oss_moe import GptOssExperts
    from layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton

    assert triton.knobs.runtime.interpret
    results = {}
    for seed, (tokens, mxfp4) in enumerate(CASES):
        experts = GptOssExperts(8, 64, 64, 1.702, 7.0, mxfp4, torch.float32, None)
        fill_experts(experts, seed)
        g = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(tokens, 64, generator=g)
        ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(tokens)]).to(torch.int32)  # experts 6, 7 idle
        weights = torch.softmax(torch.randn(tokens, 4, generator=g), dim=-1)
        results[(tokens, mxfp4)] = (gpt_oss_experts_triton(x, experts, weights, ids),
                                    experts.forward_torch(x, weights, ids))
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tokens, mxfp4", CASES)
def test_matches_torch_reference(interpreted, tokens, mxfp4):
    out, expected = interpreted[(tokens, mxfp4)]
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
