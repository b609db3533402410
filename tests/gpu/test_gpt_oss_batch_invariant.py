"""gpt-oss's MoE block (layers/moe/gpt_oss_moe.py: the Triton routing with its bias, then the
Triton experts, layers/moe/kernels/triton_mxfp4_moe.py) in batch-invariant mode on one GPU, bf16,
at gpt-oss-20b's TP1 shapes (32 experts of 2880, hidden 2880, top-4), MXFP4 and bf16-form experts,
and MXFP4 experts on the tensor-core launches (layers/moe/kernels/gluon_mxfp4_experts.py, which
are batch-invariant by construction whatever their row blocks), random weights.

A token's output has the same bits in every batch: the first 1, 7, 64, 128 and 512 of one set of
2048 random tokens each give the rows the batch of 2048 gives them. In this mode the grouped
launches of the first two forms run at every batch (never the matrix-vector ones) with the K steps, decoder and
orientation pinned (layers/moe/kernels/mxfp4_moe_config.py); the rows per expert still move the
tiles (16-row tiles up to 512 tokens, 64-row from 2048: mma.sync gives way to wgmma), so these
comparisons are what shows that the two round the same k-chunks alike here. Eager and, at 7 and 128
tokens, replayed from a CUDA graph. The batch-invariant output is within bf16 tolerance of the
default mode's. Printed with ``-s``: µs per block call (CUDA graph) in both modes at 1, 32 and 128
tokens.
"""
import pytest
import torch

from arfusion.fusion.tuning.timing import capture_cuda_graph, median_us_per_call
from tests.dist_utils import run_distributed
from tests.tolerances import TOLERANCES

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpus(1), pytest.mark.timeout(900)]

EXPERTS, HIDDEN, INTER, TOP_K = 32, 2880, 2880, 4
TOKENS = (1, 7, 64, 128, 512, 2048)
GRAPH_TOKENS = (7, 128)
TIMED_TOKENS = (1, 32, 128)


def _block_results(rank: int, world: int, form: str) -> dict:
    """One TP1 rank: the block's outputs per token count (batch-invariant mode), the graph
    replays, the default mode's output at the largest count, and the timings."""
    from arfusion.layers import batch_invariant
    from arfusion.layers.moe.gpt_oss_moe import GptOssMoeBlock
    from tests.test_gpt_oss_moe_triton import fill_experts

    block = GptOssMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, 1.702, 7.0, form != "bf16form", torch.bfloat16,
                           torch.device("cuda", 0), tensor_cores=form == "tensor-cores")
    fill_experts(block.experts, 2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN ** 0.5)
        block.router.bias.copy_(torch.randn(EXPERTS, generator=g) * 0.1)
        # activations of order one, as in the model: bf16-form weights x 0.05, MXFP4 scales / 16
        # (at fill_experts' scales the outputs' RMS is about 400, where a change in the order of
        # the fp32 sums alone puts near-zero elements outside the bf16 tolerance)
        for name in ("w13_weight", "w2_weight"):
            if hasattr(block.experts, name):
                getattr(block.experts, name).mul_(0.05)
        for name in ("w13_scales", "w2_scales"):
            if hasattr(block.experts, name):
                getattr(block.experts, name).sub_(4)
    h = torch.randn(max(TOKENS), HIDDEN, generator=g).bfloat16().cuda()
    out: dict = {"graph": {}, "us": {}}
    with torch.no_grad():
        out["default"] = block(h).cpu()
        with batch_invariant.batch_invariant_mode(True):
            out["rows"] = {t: block(h[:t]).cpu() for t in TOKENS}
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
FORM_NAMES = ("mxfp4", "bf16form", "tensor-cores")


def results(form: str) -> dict:
    if form not in _RESULTS:
        _RESULTS[form] = run_distributed(_block_results, world_size=1, args=(form,), device_kind="cuda",
                                         timeout_s=800)[0]
    return _RESULTS[form]


FORMS = pytest.mark.parametrize("form", FORM_NAMES)


@FORMS
@pytest.mark.parametrize("tokens", TOKENS[:-1])
def test_a_token_has_the_same_bits_in_every_batch(form, tokens):
    rows = results(form)["rows"]
    differing = rows[tokens] != rows[max(TOKENS)][:tokens]
    assert not differing.any(), (f"{int(differing.sum())} of {differing.numel()} elements differ, in tokens "
                                 f"{differing.any(-1).nonzero().flatten().tolist()}")


@FORMS
@pytest.mark.parametrize("tokens", GRAPH_TOKENS)
def test_a_cuda_graph_replay_gives_the_eager_bits(form, tokens):
    replayed, eager = results(form)["graph"][tokens]
    assert torch.equal(replayed, eager)


@FORMS
def test_the_mode_changes_only_the_order_of_sums(form):
    r = results(form)
    rtol, atol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(r["rows"][max(TOKENS)], r["default"], rtol=rtol, atol=atol)


def test_timing_table():
    lines = []
    for form in FORM_NAMES:
        us = results(form)["us"]
        for t in TIMED_TOKENS:
            lines.append(f"{form:12s} T={t:4d}  default {us[False, t]:8.1f} us  "
                         f"batch-invariant {us[True, t]:8.1f} us  ({us[True, t] / us[False, t]:.2f}x)")
    print("\n" + "\n".join(lines))
