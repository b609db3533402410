"""On one GPU of sm90 or newer: the bulk L2 prefetch (layers/kernels/l2_prefetch.py) and
``--prefetch-o-proj``.

`prefetch_l2` of tensors of 16 bytes to gpt-oss's o projection (23.6 MB), sizes that are not a
multiple of the chunk or of 16 bytes included: it completes and leaves every value as it was; a
view that is not 16-byte aligned is refused by name. `ahead` inside a captured CUDA graph: replays
give the eager results, with the prefetch a branch beside the block's launches. The tiny Llama in
bf16 at TP1 with CUDA graphs, the flag off and on: the same greedy tokens and logits bit for bit
(a prefetch moves no value), the prefetch launched with the flag on only. Without the flag, the
default bound (``--prefetch-o-proj-max-batch`` 1) has one prompt's decode graphs prefetch, with the
bits of bound 0."""
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.fold_checks import flag_off_and_on

pytest.importorskip("triton")

pytestmark = pytest.mark.gpus(1)

PROMPTS, PROMPT_LEN, STEPS = 3, 16, 24


def _sm90() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk L2 prefetch needs sm90 or newer")


@pytest.mark.parametrize("numel, dtype", [(8, torch.bfloat16), (500, torch.bfloat16), (32 * 1024 + 24, torch.float16),
                                          (2880 * 4096, torch.bfloat16), (1 << 20, torch.float32)])
def test_prefetch_completes_and_changes_nothing(numel, dtype):
    from arfusion.layers.kernels.l2_prefetch import prefetch_l2

    _sm90()
    t = torch.randn(numel, device="cuda").to(dtype)
    before = t.clone()
    prefetch_l2(t)
    torch.cuda.synchronize()
    assert torch.equal(t, before)


def test_a_misaligned_view_is_refused_by_name():
    from arfusion.layers.kernels.l2_prefetch import prefetch_l2

    _sm90()
    t = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="not contiguous or not 16-byte aligned"):
        prefetch_l2(t[1:])


def test_ahead_in_a_cuda_graph_replays_the_eager_results():
    from arfusion.layers.kernels.l2_prefetch import ahead

    _sm90()
    w = torch.randn(2048, 4096, device="cuda").bfloat16()
    x = torch.randn(4, 4096, device="cuda").bfloat16()

    def step() -> torch.Tensor:
        with ahead(w):
            h = torch.nn.functional.silu(x * 2)
        return h + w[:4]  # reads the prefetched weight after the join

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(4, 4096, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


def _greedy(rank: int, world: int) -> dict:
    from arfusion.layers.kernels import l2_prefetch

    return flag_off_and_on("tiny", PROMPTS, PROMPT_LEN, STEPS, "prefetch_o_proj", l2_prefetch, "issue_prefetch", seed=5,
                           dtype="bfloat16", cuda_graph_max_bs=PROMPTS, kv_slots=1024,
                           prefetch_o_proj_max_batch=0)  # off means none (the default bound takes batch 1's graph)


@pytest.mark.timeout(600)
def test_the_flag_keeps_every_bit_under_cuda_graphs():
    _sm90()
    result = run_distributed(_greedy, world_size=1, device_kind="cuda", timeout_s=500)[0]
    off, on = result[False], result[True]
    assert off["graphs"] and on["graphs"], "both runs replay CUDA graphs"
    assert off["calls"] == 0 and on["calls"] > 0, "the prefetch runs with the flag on only"
    assert on["tokens"] == off["tokens"] and torch.equal(on["logits"], off["logits"])
    assert len({t for step in off["tokens"] for t in step}) > 2, "the tokens vary (not a constant stream)"


def _batch_one(rank: int, world: int) -> dict:
    from arfusion.layers.kernels import l2_prefetch
    from tests.fold_checks import counting, greedy_run

    calls = counting(l2_prefetch, "issue_prefetch")
    out = {}
    for bound in (0, 1):
        calls[0] = 0
        out[bound] = greedy_run("tiny", 1, PROMPT_LEN, STEPS, seed=5, dtype="bfloat16", cuda_graph_max_bs=1,
                                kv_slots=1024, prefetch_o_proj_max_batch=bound)
        out[bound]["calls"] = calls[0]
    return out


@pytest.mark.timeout(600)
def test_the_default_bound_prefetches_at_batch_1_with_the_bits_without():
    _sm90()
    result = run_distributed(_batch_one, world_size=1, device_kind="cuda", timeout_s=500)[0]
    off, default = result[0], result[1]
    assert off["graphs"] and default["graphs"], "both runs replay CUDA graphs"
    assert off["calls"] == 0 and default["calls"] > 0, "the prefetch runs with the bound only"
    assert default["tokens"] == off["tokens"] and torch.equal(default["logits"], off["logits"])
