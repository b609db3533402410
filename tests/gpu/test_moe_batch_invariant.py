"""The MoE block (layers/moe/sparse_moe_block.py: the Triton routing, then the fused MoE with the
folded combine) in batch-invariant mode on one GPU, bf16, at Qwen3-30B-A3B's TP1 shapes (128
experts of 768, hidden 2048, top-8, renormalised) and Mixtral-8x7B's (8 experts of 14336, hidden
4096, top-2), random gate and expert weights.

A token's routing (weights, ids) and output have the same bits in every batch: the first 1, 7,
64, 128 and 512 of one set of 2048 random tokens each give the rows the batch of 2048 gives them
(the counts cross the routing's one-launch limit, 1 token, and the rows per expert at which the tiles grow to 32 and 64 rows and mma.sync gives way
to wgmma: Qwen3-30B-A3B's 1 to 128 tokens take 16-row tiles, 512 tokens 32-row, 2048 tokens
64-row; Mixtral's 1 to 64 tokens 16-row, 128 tokens 32-row, 512 and 2048 tokens 64-row. In
batch-invariant mode the tiles are the default's with only the K steps pinned, so these
comparisons are what shows that wgmma and mma.sync round the same k-chunks alike on this GPU),
eager and, at 7 and 128 tokens, replayed from a CUDA graph. The batch-invariant output is within bf16 tolerance of the
default mode's (the same math in another order of sums). Printed with ``-s``: µs per block call
(CUDA graph) in both modes at 1, 32 and 128 tokens.
"""
import pytest
import torch

from arfusion.fusion.tuning.timing import capture_cuda_graph, median_us_per_call
from tests.dist_utils import run_distributed
from tests.tolerances import TOLERANCES

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpus(1), pytest.mark.timeout(900)]

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}  # (E, H, I, k)
TOKENS = (1, 7, 64, 128, 512, 2048)
GRAPH_TOKENS = (7, 128)
TIMED_TOKENS = (1, 32, 128)


def _block_results(rank: int, world: int, shape: str) -> dict:
    """Collective of one TP1 rank: the block's outputs per token count (batch-invariant mode), the
    graph replays, the default mode's output at the largest count, and the timings."""
    from arfusion.layers import batch_invariant
    from arfusion.layers.moe import SparseMoeBlock

    experts, hidden, inter, top_k = SHAPES[shape]
    device = torch.device("cuda", 0)
    block = SparseMoeBlock(hidden, experts, top_k, inter, True, torch.bfloat16, device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(experts, hidden, generator=g, device=device) / hidden ** 0.5)
        block.experts.w13_weight.copy_(torch.randn(block.experts.w13_weight.shape, generator=g, device=device)
                                       / hidden ** 0.5)
        block.experts.w2_weight.copy_(torch.randn(block.experts.w2_weight.shape, generator=g, device=device)
                                      / inter ** 0.5)
    h = torch.randn(max(TOKENS), hidden, generator=g, device=device).bfloat16()
    out: dict = {"graph": {}, "us": {}}
    with torch.no_grad():
        out["default"] = block(h).cpu()
        with batch_invariant.batch_invariant_mode(True):
            out["rows"] = {t: block(h[:t]).cpu() for t in TOKENS}
            out["routing"] = {t: tuple(r.cpu() for r in block.gate(h[:t])) for t in TOKENS}
            for t in GRAPH_TOKENS:
                static = h[:t].clone()
                graph, captured = capture_cuda_graph(lambda: block(static))
                static.copy_(h[max(TOKENS) - t:])  # other tokens than at capture
                graph.replay()
                out["graph"][t] = (captured.cpu(), block(h[max(TOKENS) - t:]).cpu())
        for on in (False, True):
            with batch_invariant.batch_invariant_mode(on):
                for t in TIMED_TOKENS:
                    out["us"][on, t] = median_us_per_call(lambda: [block(h[:t]) for _ in range(20)], 20)
    return out


_RESULTS: dict[str, dict] = {}


def results(shape: str) -> dict:
    if shape not in _RESULTS:
        _RESULTS[shape] = run_distributed(_block_results, world_size=1, args=(shape,), device_kind="cuda",
                                          timeout_s=800)[0]
    return _RESULTS[shape]


@pytest.mark.parametrize("tokens", TOKENS[:-1])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_token_has_the_same_bits_in_every_batch(shape, tokens):
    rows = results(shape)["rows"]
    assert torch.equal(rows[tokens], rows[max(TOKENS)][:tokens]), (shape, tokens)


@pytest.mark.parametrize("tokens", TOKENS[:-1])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_token_has_the_same_routing_in_every_batch(shape, tokens):
    routing = results(shape)["routing"]
    for part, whole in zip(routing[tokens], routing[max(TOKENS)]):
        assert torch.equal(part, whole[:tokens]), (shape, tokens)


@pytest.mark.parametrize("tokens", GRAPH_TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_cuda_graph_replay_gives_the_eager_bits(shape, tokens):
    replayed, eager = results(shape)["graph"][tokens]
    assert torch.equal(replayed, eager)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_mode_changes_only_the_order_of_sums(shape):
    r = results(shape)
    rtol, atol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(r["rows"][max(TOKENS)], r["default"], rtol=rtol, atol=atol)


def test_timing_table():
    lines = []
    for shape in SHAPES:
        us = results(shape)["us"]
        for t in TIMED_TOKENS:
            lines.append(f"{shape:14s} T={t:4d}  default {us[False, t]:8.1f} us  batch-invariant {us[True, t]:8.1f} us"
                         f"  ({us[True, t] / us[False, t]:.2f}x)")
    print("\n" + "\n".join(lines))
