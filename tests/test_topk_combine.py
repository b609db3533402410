"""The top-k combine and the combine inside the next add + RMSNorm
(layers/moe/kernels/triton_topk_combine.py) under Triton's CPU interpreter (one spawned child with
TRITON_INTERPRET=1; skipped without triton); the fusion op's side is tests/test_unformed_sum.py.

Inputs: random fp32 partials (1 to 3 K splits, every slot non-zero), routing weights, residuals
and norm weights (1 + 0.1 N(0, 1)); 1, 3 and 17 tokens of top-2 and top-4 at hidden 96 (one
masked block of 128 columns) and 2880 (gpt-oss's, a block of 4096), fp32 and fp16 (the
interpreter casts to bf16 by truncation, not to nearest: bf16 runs in
tests/gpu/test_topk_combine_gpu.py). Reference: the rows summed,
rounded and weighted in torch in the kernel's order, then `fusion.reference.add_rms_norm`.

Tolerances: the combine and the sum ``m + residual`` are the same fp32 operations in the same
order as the reference, so their bits are equal; the normed output differs only by the order of
the sum of squares (a tree in the kernel, torch's reduction in the reference) and the reciprocal
square root: rtol 1e-5 in fp32, and one ulp of fp16 (rtol 2^-10) where the two round on either
side of a tie."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter

pytest.importorskip("triton")

CASES = [(1, 2, 96, 1, torch.float32), (3, 4, 96, 2, torch.float32), (17, 4, 96, 3, torch.float32),
         (1, 4, 2880, 1, torch.float32), (3, 4, 2880, 2, torch.float16), (5, 2, 96, 1, torch.float16)]
RTOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10}


def _inputs(tokens: int, top_k: int, hidden: int, splits: int, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    partial = torch.randn(splits, tokens * top_k, hidden, generator=g)
    weights = torch.rand(tokens, top_k, generator=g) + 0.05
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return partial, weights, residual, norm_weight


def _reference(partial: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from arfusion.fusion import reference

    tokens, top_k = weights.shape
    rows = partial[0].clone()
    for s in range(1, partial.shape[0]):
        rows += partial[s]
    rows = rows.to(residual.dtype).float().view(tokens, top_k, -1)
    total = torch.zeros(tokens, partial.shape[2])
    for j in range(top_k):
        total += weights[:, j, None] * rows[:, j]
    combined = total.to(residual.dtype)
    normed, summed = reference.add_rms_norm(combined, residual, norm_weight, eps)
    return combined, normed, summed


def _interpreted(rank: int, world: int) -> list:
    from arfusion.layers.moe.kernels.triton_topk_combine import TopKCombine, combine, combine_add_rms_norm

    out = []
    for i, (tokens, top_k, hidden, splits, dtype) in enumerate(CASES):
        partial, weights, residual, norm_weight = _inputs(tokens, top_k, hidden, splits, dtype, i)
        combined = combine(partial, weights, dtype)
        normed, summed = combine_add_rms_norm(partial, weights, residual, norm_weight, 1e-5)
        unformed = TopKCombine(partial, weights, dtype)
        out.append((combined, normed, summed, unformed.materialize(), unformed.add_rms_norm(residual, norm_weight, 1e-5),
                    residual))
    return out


@pytest.fixture(scope="module")
def interpreted() -> list:
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"T{c[0]}-k{c[1]}-H{c[2]}-S{c[3]}-{c[4]}" for c in CASES])
def test_the_launches_against_the_reference(interpreted, index):
    tokens, top_k, hidden, splits, dtype = CASES[index]
    partial, weights, residual, norm_weight = _inputs(tokens, top_k, hidden, splits, dtype, index)
    combined, normed, summed, materialized, (normed2, summed2), residual_after = interpreted[index]
    ref_combined, ref_normed, ref_summed = _reference(partial, weights, residual, norm_weight, 1e-5)
    assert combined.dtype == normed.dtype == summed.dtype == dtype
    assert torch.equal(combined, ref_combined) and torch.equal(materialized, ref_combined)
    assert torch.equal(summed, ref_summed) and torch.equal(summed2, ref_summed)
    assert torch.equal(residual_after, residual), "the residual is not written"
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=RTOL[dtype], atol=0)
    assert torch.equal(normed, normed2)


def test_bad_inputs_are_named():
    from arfusion.layers.moe.kernels.triton_topk_combine import NORM_MAX_HIDDEN, TopKCombine, combine_add_rms_norm

    partial, weights, residual, norm_weight = _inputs(2, 4, 96, 1, torch.float32, 0)
    with pytest.raises(ValueError, match="topk_weights"):
        TopKCombine(partial, weights[:1], torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        TopKCombine(partial.half(), weights, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        combine_add_rms_norm(partial, weights, residual[:1], norm_weight, 1e-5)
    with pytest.raises(ValueError, match="norm weight"):
        combine_add_rms_norm(partial, weights, residual, norm_weight[:5], 1e-5)
    wide = torch.zeros(1, 2, NORM_MAX_HIDDEN + 32)
    with pytest.raises(ValueError, match="one-launch norm"):
        combine_add_rms_norm(wide, torch.ones(1, 2), torch.zeros(1, NORM_MAX_HIDDEN + 32),
                             torch.ones(NORM_MAX_HIDDEN + 32), 1e-5)
    unformed = TopKCombine(wide, torch.ones(1, 2), torch.float32)
    assert unformed.add_rms_norm(torch.zeros(1, NORM_MAX_HIDDEN + 32), torch.ones(NORM_MAX_HIDDEN + 32), 1e-5) is None
    declining = TopKCombine(partial, weights, torch.float32)
    assert declining.add_rms_norm(residual.half(), norm_weight, 1e-5) is None
    assert declining.add_rms_norm(residual.t().contiguous().t(), norm_weight, 1e-5) is None
    assert declining.add_rms_norm(residual, torch.randn(96, 2)[:, 0], 1e-5) is None  # a strided norm weight


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_benchmark_refuses_without_a_gpu(monkeypatch):
    import sys

    from arfusion.benchmarks.kernels import bench_topk_combine

    monkeypatch.setattr(sys, "argv", ["bench_topk_combine", "--tokens", "1"])
    with pytest.raises(SystemExit, match="bench_topk_combine needs a CUDA GPU"):
        bench_topk_combine.main()
