"""The Triton fused MoE (layers/moe/kernels/triton_fused_moe.py) on one GPU, bf16, at the TP2 shards of
Qwen3-30B-A3B (128 experts of 768 / 2 = 384 columns, hidden 2048, top-8) and Mixtral-8x7B
(8 experts of 14336 / 2 = 7168, hidden 4096, top-2).

Token counts 1 (most experts get no token), 8, 64, 256 and 4096, and every token on one expert.
Against a float64 truth computed from the same bf16 inputs and routing, by RMS error over all
outputs:
- the unfused combine (launch 2 writes each expert's output rounded to bf16, torch combines): the
  torch reference's rounding steps, so within 1.25x the torch reference's error;
- the folded combine (weights and top-k sum in launch 2's epilogue, one rounding): at most 1.5x
  the unfused combine's error (it should be below it), and bit-identical from run to run (the
  last-arriving program sums a token's rows in slot order, whichever program that is).
Then the kernels through `MoEExperts` captured in a CUDA graph and replayed with new routing, and
the ``tiny-moe`` model (fp32) on the GPU against the CPU (one spawned TP1 rank); then,
printed with ``-s``, a table of µs per call (CUDA graphs) for both combines with the expert-weight
bandwidth at decode sizes (the HBM fraction of the weights of the experts hit) and, at 4096
tokens, the time of a dense bf16 GEMM of the same FLOPs.
"""
import pytest
import torch

from arfusion.fusion.tuning.timing import capture_cuda_graph, median_us_per_call

pytest.importorskip("triton")

from arfusion.layers.moe.router import select_experts  # noqa: E402
from arfusion.layers.moe.torch_experts import expert_outputs, moe_experts_torch  # noqa: E402
from arfusion.layers.moe.kernels.triton_fused_moe import fused_moe  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEVICE = torch.device("cuda", 0)
HBM_BYTES_PER_S = 4.8e12  # H200
SHAPES = {"qwen3-30b-a3b-tp2": (128, 2048, 384, 8), "mixtral-8x7b-tp2": (8, 4096, 7168, 2)}  # (E, H, I per rank, k)
TOKENS = (1, 8, 64, 256, 4096)


def _weights(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    experts, hidden, inter, _ = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, device=DEVICE) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, device=DEVICE) / inter ** 0.5
    return w13.bfloat16(), w2.bfloat16()


_WEIGHTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def weights(shape: str) -> tuple[torch.Tensor, torch.Tensor]:
    if shape not in _WEIGHTS:
        _WEIGHTS.clear()  # one shape's weights on the device at a time
        _WEIGHTS[shape] = _weights(shape)
    return _WEIGHTS[shape]


def routed_input(shape: str, tokens: int, seed: int, one_expert: bool = False) -> tuple[torch.Tensor, ...]:
    """``(x bf16 [T, H], topk_weights fp32, topk_ids int32)``; ``one_expert``: expert 5 first for every token."""
    experts, hidden, _, top_k = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).bfloat16()
    logits = torch.randn(tokens, experts, generator=g, device=DEVICE)
    if one_expert:
        logits[:, 5] = logits.max(dim=1).values + 0.5
    topk_weights, topk_ids = select_experts(logits, top_k, renormalize=True)
    return x, topk_weights, topk_ids


def truth(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    y = expert_outputs(x.double(), w13.double(), w2.double(), topk_ids)
    return (y * topk_weights.double()[..., None]).sum(dim=1)


def rms_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.double() - expected).pow(2).mean().sqrt().item()


CASES = [(s, t, False) for s in SHAPES for t in TOKENS] + [(s, 512, True) for s in SHAPES]


@pytest.mark.parametrize("shape,tokens,one_expert", CASES)
def test_against_float64_truth(shape, tokens, one_expert):
    w13, w2 = weights(shape)
    x, topk_weights, topk_ids = routed_input(shape, tokens, seed=tokens, one_expert=one_expert)
    expected = truth(x, w13, w2, topk_weights, topk_ids)
    reference = rms_error(moe_experts_torch(x, w13, w2, topk_weights, topk_ids), expected)
    unfused_out = fused_moe(x, w13, w2, topk_weights, topk_ids, combine="unfused")
    folded_out = fused_moe(x, w13, w2, topk_weights, topk_ids, combine="folded")
    unfused, folded = rms_error(unfused_out, expected), rms_error(folded_out, expected)
    print(f"\n{shape} T={tokens}{' one expert' if one_expert else ''}: RMS error torch {reference:.3e}, "
          f"unfused {unfused:.3e}, folded {folded:.3e}")
    assert unfused_out.dtype == folded_out.dtype == torch.bfloat16
    assert unfused <= 1.25 * reference
    assert folded <= 1.5 * unfused
    assert torch.equal(fused_moe(x, w13, w2, topk_weights, topk_ids, combine="folded"), folded_out), "deterministic"


def _graph_and_model(rank: int, world: int) -> dict:
    """(One CUDA rank, TP1.) `MoEExperts` captured at 1 and 32 tokens and replayed with new inputs
    and routing, against eager `fused_moe`; the ``tiny-moe`` model (fp32) on the GPU against the
    same model on the CPU (the torch reference path)."""
    from arfusion.engine.models.builtin import builtin_config
    from arfusion.engine.models.forward_batch import ForwardBatch
    from arfusion.engine.models.registry import build_model
    from arfusion.engine.weights.dummy import dummy_weights
    from arfusion.layers.moe.experts import MoEExperts
    from tests.dist_utils import make_fusion

    shape = "qwen3-30b-a3b-tp2"
    num_experts, hidden, inter, _ = SHAPES[shape]
    w13, w2 = weights(shape)
    layer = MoEExperts(num_experts, hidden, inter, torch.bfloat16, DEVICE)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    replays_equal = []
    for tokens in (1, 32):
        static = [t.clone() for t in routed_input(shape, tokens, seed=1)]
        graph, out = capture_cuda_graph(lambda: layer(*static))
        for seed in (2, 3):
            x, topk_weights, topk_ids = routed_input(shape, tokens, seed=seed)
            for dst, src in zip(static, (x, topk_weights, topk_ids)):
                dst.copy_(src)
            graph.replay()
            replays_equal.append(torch.equal(out, fused_moe(x, w13, w2, topk_weights, topk_ids)))
    config = builtin_config("tiny-moe")
    logits = {}
    for device in (DEVICE, torch.device("cpu")):
        model = build_model(config, make_fusion(config.hidden_size), torch.float32, device)
        model.load_weights(dummy_weights(config, seed=4))
        batch = ForwardBatch.from_lists([[5, 200, 17, 3, 99], [42, 7]], [[0, 1, 2, 3, 4], [5, 6]], device)
        logits[device.type] = model(batch, model.allocate_kv_cache(16)).gather().cpu()
    return {"replays_equal": replays_equal, "logits": logits}


def test_experts_in_a_cuda_graph_and_the_tiny_moe_model():
    result = run_distributed(_graph_and_model, world_size=1, device_kind="cuda", timeout_s=300)[0]
    assert all(result["replays_equal"])
    torch.testing.assert_close(result["logits"]["cuda"], result["logits"]["cpu"], rtol=1e-4, atol=1e-4)


def _expert_bytes(shape: str, topk_ids: torch.Tensor) -> int:
    _, hidden, inter, _ = SHAPES[shape]
    return int(topk_ids.unique().numel()) * 3 * hidden * inter * 2


def test_timing_table():
    rows = []
    for shape in SHAPES:
        w13, w2 = weights(shape)
        for tokens in TOKENS:
            x, topk_weights, topk_ids = routed_input(shape, tokens, seed=tokens)
            us = {combine: median_us_per_call(lambda c=combine: fused_moe(x, w13, w2, topk_weights, topk_ids, combine=c), 1)
                  for combine in ("folded", "unfused")}
            gbps = _expert_bytes(shape, topk_ids) / (us["folded"] * 1e-6) / 1e9
            row = f"{shape:18s} T={tokens:5d}  folded {us['folded']:8.1f} us  unfused {us['unfused']:8.1f} us  " \
                  f"weights {gbps:7.0f} GB/s ({100 * gbps * 1e9 / HBM_BYTES_PER_S:4.1f}% HBM)"
            if tokens == TOKENS[-1]:
                slots, hidden, inter = tokens * SHAPES[shape][3], w13.shape[2], w2.shape[2]
                a = torch.randn(slots, hidden, device=DEVICE).bfloat16()
                b = torch.randn(hidden, 3 * inter, device=DEVICE).bfloat16()
                dense = median_us_per_call(lambda: a @ b, 1)
                row += f"  dense GEMM of the same FLOPs {dense:8.1f} us ({us['folded'] / dense:.2f}x)"
            rows.append(row)
    print("\n" + "\n".join(rows))
