"""The grouped bf16 experts' output left unformed (`fused_moe(..., unformed=True)`, a
`TopKCombine` of launch 2's weighted fp32 rows) under Triton's CPU interpreter (one spawned child
with TRITON_INTERPRET=1; skipped without triton), against the folded combine of the same call.

Inputs: tests/test_moe_triton.py's cases (8 experts, hidden 80, intermediate 48, random weights and
routings): 7 and 64 tokens of top-2 and every token's first slot on one expert, fp32 and fp16,
the default tiles and 16 x 32 x 32 ones; residuals N(0, 1), norm weights 1 + 0.1 N(0, 1).

Tolerances: the unformed rows summed in slot order are the folded combine's fp32 operations in its
order, so `materialize` gives its bits, and ``round(m + residual)`` the bits of
`fusion.reference.add_rms_norm`'s sum; the normed output differs from that reference only by the
order of the sum of squares and the reciprocal square root: rtol 1e-5 in fp32, one ulp of fp16
(2^-10) where the two round on either side of a tie. A call the matrix-vector launches take (one
token of top-2: 2 slots over 8 experts) leaves its per-slot rows (`moe_gemv`'s ``unformed``): their
sum in slot order reassociates that launch's sum over the slots, so `materialize` is within
rtol 1e-6 of the folded call in fp32 and one ulp in fp16. Past `ROWS_MAX_TOKENS` tokens
(`moe_gemv` called with 2) the matrix-vector launches return the folded tensor itself."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter
from tests.test_moe_triton import case_inputs

pytest.importorskip("triton")

RUNS = [("7 tokens", torch.float32, "default"), ("64 tokens", torch.float16, "default"),
        ("slot 0 on one expert", torch.float32, "small"), ("64 tokens", torch.float32, "small")]
RTOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10}
EPS = 1e-6


def _norm_inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(dtype), (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)


def _interpreted(rank: int, world: int) -> list:
    from arfusion.layers.moe.kernels.triton_fused_moe import MoEBlockConfig, fused_moe
    from arfusion.layers.moe.kernels.triton_moe_gemv import moe_gemv

    tiles = {"default": None, "small": MoEBlockConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=32,
                                                      block_n_down=32, block_k_down=32)}
    out = []
    for i, (name, dtype, tile) in enumerate(RUNS):
        inputs = case_inputs(name, dtype)
        config = tiles[tile]
        folded = fused_moe(*inputs, config=config)
        unformed = fused_moe(*inputs, config=config, unformed=True)
        residual, weight = _norm_inputs(inputs[0].shape[0], inputs[0].shape[1], dtype, i)
        out.append((folded, type(unformed).__name__, unformed.applied, unformed.shape, unformed.dtype,
                    unformed.materialize(), unformed.add_rms_norm(residual, weight, EPS)))
    for dtype in (torch.float32, torch.float16):
        inputs = case_inputs("1 token", dtype)
        unformed = fused_moe(*inputs, unformed=True)
        out.append((fused_moe(*inputs), type(unformed).__name__, unformed.materialize()))
    x, w13, w2, weights, ids = case_inputs("7 tokens", torch.float32)
    two = (x[:2], w13, w2, weights[:2], ids[:2])
    out.append((moe_gemv(*two), moe_gemv(*two, unformed=True)))
    return out


@pytest.fixture(scope="module")
def interpreted() -> list:
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{r[0]}-{r[1]}-{r[2]}".replace(" ", "_") for r in RUNS])
def test_the_rows_summed_in_the_norm_are_the_folded_combine(interpreted, index):
    from arfusion.fusion import reference

    name, dtype, _ = RUNS[index]
    folded, kind, applied, shape, out_dtype, materialized, (normed, summed) = interpreted[index]
    assert kind == "TopKCombine" and applied and out_dtype == dtype and shape == folded.shape
    assert torch.equal(materialized, folded)
    residual, weight = _norm_inputs(folded.shape[0], folded.shape[1], dtype, index)
    ref_normed, ref_summed = reference.add_rms_norm(folded, residual, weight, EPS)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=RTOL[dtype], atol=0)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_matrix_vector_launches_leave_their_rows(interpreted, dtype):
    folded, kind, materialized = interpreted[len(RUNS) + (dtype == torch.float16)]
    assert kind == "TopKCombine" and materialized.dtype == dtype
    torch.testing.assert_close(materialized.float(), folded.float(), rtol=RTOL[dtype] / 10 if dtype == torch.float32
                               else RTOL[dtype], atol=0)


@pytest.mark.timeout(700)
def test_past_the_rows_bound_the_matrix_vector_launches_return_the_folded_tensor(interpreted):
    folded, unformed = interpreted[-1]
    assert isinstance(unformed, torch.Tensor) and torch.equal(unformed, folded)
