"""The top-k combine inside the next add + RMSNorm (layers/moe/kernels/triton_topk_combine.py) on
the GPU, bf16 at gpt-oss's hidden size 2880 and top-4, 1 / 32 / 512 tokens, one K split and two;
random partials, routing weights, residuals and norm weights (1 + 0.1 N(0, 1)).

Against the two launches it replaces, the combine (`combine`) then flashinfer's in-place
``fused_add_rmsnorm`` (`fusion.norm.add_rms_norm`), and against `fusion.reference.add_rms_norm`
of the combine: the residual sum has the same bits (both launches form the combine with one
Triton helper, and the sum is one fp32 add rounded to bf16); the normed output lies within one
bf16 ulp of flashinfer's (rtol 2^-7: the sum of squares in another order, and flashinfer
normalises the fp32 sum where both ours and the reference normalise the rounded one) and of the
reference's. Then in a CUDA graph replayed on new inputs: the same bits as eager.

The bf16 experts' rows left unformed (`fused_moe(..., unformed=True)`, the ``applied`` form) at
Qwen3-30B-A3B's shapes (128 experts of 768 x 2048, top-8, random weights N(0, 1) / sqrt(fan-in),
routings of random logits). The grouped launches (8, 32 and 256 tokens): `materialize` has the
folded combine's bits (the same fp32 sums in the same order), and the one launch with the norm
the folded combine's residual sum and a normed output within one bf16 ulp of flashinfer's. The
matrix-vector launches at 1 token, whose per-slot rows the norm sums in slot order where their
folded launch sums a token's slots by a tree: `materialize` within one bf16 ulp of the folded
output, the residual sum and the normed output within two of the folded combine then
flashinfer's norm; at 4 tokens (past `ROWS_MAX_TOKENS`) they return the folded output itself.
"""
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.gpus(1)

HIDDEN, TOP_K, EPS = 2880, 4, 1e-5
ULP = 2.0 ** -7  # bf16's relative spacing


def _inputs(tokens: int, splits: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    partial = torch.randn(splits, tokens * TOP_K, HIDDEN, generator=g, device="cuda")
    weights = torch.rand(tokens, TOP_K, generator=g, device="cuda") + 0.05
    residual = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16()
    return partial, weights, residual, norm_weight


@pytest.mark.parametrize("tokens", [1, 32, 512])
@pytest.mark.parametrize("splits", [1, 2])
def test_one_launch_against_the_combine_then_flashinfer(tokens, splits):
    from arfusion.fusion import norm, reference
    from arfusion.layers.moe.kernels.triton_topk_combine import combine, combine_add_rms_norm

    partial, weights, residual, norm_weight = _inputs(tokens, splits, tokens + splits)
    normed, summed = combine_add_rms_norm(partial, weights, residual, norm_weight, EPS)
    combined = combine(partial, weights, torch.bfloat16)
    ref_normed, ref_summed = reference.add_rms_norm(combined, residual, norm_weight, EPS)
    fi_normed, fi_summed = norm.add_rms_norm(combined.clone(), residual.clone(), norm_weight, EPS)
    assert torch.equal(summed, ref_summed) and torch.equal(summed, fi_summed)
    torch.testing.assert_close(normed.float(), fi_normed.float(), rtol=ULP, atol=1e-6)
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=ULP, atol=1e-6)


def test_cuda_graph_replay_equals_eager():
    from arfusion.layers.moe.kernels.triton_topk_combine import combine_add_rms_norm

    partial, weights, residual, norm_weight = _inputs(8, 1, 0)
    combine_add_rms_norm(partial, weights, residual, norm_weight, EPS)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = combine_add_rms_norm(partial, weights, residual, norm_weight, EPS)
    new = _inputs(8, 1, 1)
    for buffer, value in zip((partial, weights, residual), new[:3]):
        buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    expected = combine_add_rms_norm(partial, weights, residual, norm_weight, EPS)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))


@pytest.mark.parametrize("tokens", [1, 4, 8, 32, 256])
def test_experts_rows_formed_in_the_norm(tokens):
    from arfusion.fusion import norm, reference
    from arfusion.layers.moe.kernels.triton_fused_moe import fused_moe
    from arfusion.layers.moe.router import select_experts

    experts, hidden, inter, top_k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device="cuda") / inter ** 0.5).bfloat16()
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g, device="cuda"), top_k, renormalize=True)
    residual = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).bfloat16()
    folded = fused_moe(x, w13, w2, weights, ids)
    unformed = fused_moe(x, w13, w2, weights, ids, unformed=True)
    if tokens == 4:
        assert isinstance(unformed, torch.Tensor) and torch.equal(unformed, folded)
        return
    normed, summed = unformed.add_rms_norm(residual, norm_weight, EPS)
    ref_normed, ref_summed = reference.add_rms_norm(folded, residual, norm_weight, EPS)
    fi_normed, fi_summed = norm.add_rms_norm(folded.clone(), residual.clone(), norm_weight, EPS)
    assert unformed.applied
    if tokens * top_k <= 32:  # the matrix-vector launches: the slots' sum reassociated
        torch.testing.assert_close(unformed.materialize().float(), folded.float(), rtol=ULP, atol=1e-6)
        torch.testing.assert_close(summed.float(), fi_summed.float(), rtol=2 * ULP, atol=1e-6)
        torch.testing.assert_close(normed.float(), fi_normed.float(), rtol=2 * ULP, atol=1e-6)
        return
    assert torch.equal(unformed.materialize(), folded)
    assert torch.equal(summed, ref_summed) and torch.equal(summed, fi_summed)
    for other in (ref_normed, fi_normed):
        ulps = ((normed.float() - other.float()).abs() / (other.float().abs() * ULP).clamp_min(1e-30)).max().item()
        print(f"tokens {tokens}: normed against {'the reference' if other is ref_normed else 'flashinfer'}: "
              f"at most {ulps:.2f} of bf16's relative spacing")
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=ULP, atol=1e-6)
    torch.testing.assert_close(normed.float(), fi_normed.float(), rtol=2 * ULP, atol=1e-6)
