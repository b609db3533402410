"""The matrix-vector MoE experts (layers/moe/kernels/triton_moe_gemv.py) on one GPU, bf16, at
Qwen3-30B-A3B's TP1 shapes (128 experts of 768 columns, hidden 2048, top-8: 8 to 32 slots) and
Mixtral-8x7B's TP2 shards (8 experts of 7168, hidden 4096, top-2: 2 to 32 slots).

Against a float64 truth from the same bf16 inputs and routing, by RMS error over all outputs: at
most 1.25x the torch reference's (layers/moe/torch_experts.py: the same roundings plus one per
expert row, so this path should be below it); the same bits from run to run, and replayed in a
CUDA graph with new inputs and routing, the bits of eager calls; `fused_moe` without a config
takes this path where `uses_gemv` holds (the bits of `DEFAULT_GEMV_CONFIG`'s form). Both forms of
launch 1's sums (`MoEGemvConfig.sum_each_step`)."""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.fusion.tuning.timing import capture_cuda_graph  # noqa: E402
from arfusion.layers.moe.kernels.triton_fused_moe import fused_moe, uses_gemv  # noqa: E402
from arfusion.layers.moe.kernels.triton_moe_gemv import DEFAULT_GEMV_CONFIG, MoEGemvConfig, moe_gemv  # noqa: E402
from arfusion.layers.moe.router import select_experts  # noqa: E402
from arfusion.layers.moe.torch_experts import expert_outputs, moe_experts_torch  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEVICE = torch.device("cuda", 0)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b-tp2": (8, 4096, 7168, 2)}  # (E, H, I, k)
CASES = [("qwen3-30b-a3b", t) for t in (1, 2, 4)] + [("mixtral-8x7b-tp2", t) for t in (1, 5, 16)]


def make_inputs(shape: str, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(x, w13, w2, topk_weights, topk_ids)``: bf16 N(0, 1) activations, weights scaled by
    1/sqrt(fan-in), softmax top-k routing of random logits."""
    experts, hidden, inter, top_k = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=DEVICE) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=DEVICE) / inter ** 0.5).bfloat16()
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g, device=DEVICE), top_k, renormalize=True)
    return x, w13, w2, weights, ids


def rms_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.double() - expected).pow(2).mean().sqrt().item()


@pytest.mark.parametrize("summed", [False, True], ids=["step-accumulators", "summed-steps"])
@pytest.mark.parametrize("shape,tokens", CASES)
def test_against_float64_truth(shape, tokens, summed):
    x, w13, w2, weights, ids = make_inputs(shape, tokens, seed=tokens)
    expected = (expert_outputs(x.double(), w13.double(), w2.double(), ids) * weights.double()[..., None]).sum(dim=1)
    config = MoEGemvConfig(sum_each_step=summed)
    out = moe_gemv(x, w13, w2, weights, ids, config)
    reference = rms_error(moe_experts_torch(x, w13, w2, weights, ids), expected)
    error = rms_error(out, expected)
    print(f"\n{shape} T={tokens} summed={summed}: RMS error torch {reference:.3e}, "
          f"gemv {error:.3e}")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert error <= 1.25 * reference
    assert torch.equal(moe_gemv(x, w13, w2, weights, ids, config), out), "deterministic"
    if uses_gemv(ids.numel(), w13.shape[0]) and config == DEFAULT_GEMV_CONFIG:
        assert torch.equal(fused_moe(x, w13, w2, weights, ids), out), "fused_moe's dispatch"


def test_cuda_graph_replays_equal_eager_calls():
    x, w13, w2, weights, ids = make_inputs("qwen3-30b-a3b", 4, seed=1)
    static = [x.clone(), weights.clone(), ids.clone()]
    graph, out = capture_cuda_graph(lambda: moe_gemv(static[0], w13, w2, static[1], static[2]))
    for seed in (2, 3):
        new_x, _, _, new_weights, new_ids = make_inputs("qwen3-30b-a3b", 4, seed=seed)
        for dst, src in zip(static, (new_x, new_weights, new_ids)):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, moe_gemv(new_x, w13, w2, new_weights, new_ids))
