"""The Triton decode attention on one GPU, bf16, llama3-8b TP2 shapes (16 query heads, 4 KV heads,
head_dim 128): captured once in a CUDA graph and replayed with new inputs and new seq_lens,
against the fp32 torch reference (also reading its rows through row ids, as the CUDA-graph
runner does); a graph of several calls replayed many times; then a timing table against the layer's torch decode path (run with ``-s`` to see it)."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from arfusion.benchmarks.kernels.attention_timing import time_decode_attention  # noqa: E402
from arfusion.fusion.tuning.timing import capture_cuda_graph  # noqa: E402
from arfusion.layers.attention import Attention  # noqa: E402
from arfusion.layers.kernels.triton_decode_attention import choose_launch, decode_attention, decode_attention_reference  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

pytestmark = pytest.mark.gpus(1)

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5
LAYERS = 4  # calls per graph in the repeated-replay test
REPEATS = 20  # replays per input there


def _refill(q, k_cache, v_cache, req_to_token, seq_lens, seed: int) -> None:
    """New random contents for the graph's static inputs, in place: q (scaled so the softmax is
    peaked), both caches, a fresh slot permutation per row, ragged seq_lens with 1 and the full
    width among them (when the batch has two rows or more)."""
    gen = torch.Generator(device=q.device).manual_seed(seed)
    batch, context = req_to_token.shape
    q.copy_(2 * torch.randn(q.shape, generator=gen, device=q.device))
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen, device=q.device))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen, device=q.device))
    req_to_token.copy_(torch.randperm(k_cache.shape[0], generator=gen, device=q.device)[:batch * context].view(batch, context))
    lens = torch.randint(1, context + 1, (batch,), generator=gen, device=q.device)
    lens[-1] = context
    if batch > 1:
        lens[0] = 1
    seq_lens.copy_(lens)


def _buffers(batch: int, context: int) -> tuple[torch.Tensor, ...]:
    """Empty ``q, k_cache, v_cache, req_to_token, seq_lens`` of a batch and table width on GPU 0
    (`_refill` fills them)."""
    dev = torch.device("cuda", 0)
    k_cache = torch.empty(batch * context + 5, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    return (torch.empty(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=dev), k_cache, torch.empty_like(k_cache),
            torch.empty(batch, context, dtype=torch.int64, device=dev), torch.empty(batch, dtype=torch.int64, device=dev))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,context", [(1, 8192), (3, 300), (32, 4096), (128, 1024), (256, 512)])
def test_graph_replay_matches_reference(batch, context):
    q, k_cache, v_cache, req_to_token, seq_lens = _buffers(batch, context)
    _refill(q, k_cache, v_cache, req_to_token, seq_lens, seed=0)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, SCALE)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, SCALE)

    rtol, atol = TOLERANCES[DTYPE]
    for seed in (1, 2, 3):
        _refill(q, k_cache, v_cache, req_to_token, seq_lens, seed)
        out.fill_(float("nan"))  # every element must be written by the replay
        graph.replay()
        expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, SCALE)
        eager = decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, SCALE)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        rel_l2 = ((out.float() - expected).norm() / expected.norm()).item()
        assert rel_l2 < 1e-2, f"seed {seed}: relative L2 error {rel_l2:.2e}"
        torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)  # the replay is the eager call, bit for bit


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,context", [(1, 8192), (3, 300), (128, 1024)])
def test_graph_replay_with_row_ids(batch, context):
    """The kernel reading rows ``row_ids`` of a request table of 2B + 1 rows (the other rows
    random slots), captured once; each replay with new rows, slots and lengths equals the
    reference and, bit for bit, the eager call on the gathered rows."""
    dev = torch.device("cuda", 0)
    q = torch.empty(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    k_cache = torch.empty(batch * context + 5, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    v_cache = torch.empty_like(k_cache)
    table = torch.empty(2 * batch + 1, context, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(batch, dtype=torch.int64, device=dev)
    row_ids = torch.empty(batch, dtype=torch.int64, device=dev)

    def refill(seed: int) -> None:
        gen = torch.Generator(device=dev).manual_seed(seed)
        _refill(q, k_cache, v_cache, table[:batch], seq_lens, seed)
        table.copy_(table[torch.randint(0, batch, (table.shape[0],), generator=gen, device=dev)])
        row_ids.copy_(torch.randperm(table.shape[0], generator=gen, device=dev)[:batch])

    refill(seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, k_cache, v_cache, table, seq_lens, SCALE, row_ids=row_ids)  # compiles outside
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, table, seq_lens, SCALE, row_ids=row_ids)

    rtol, atol = TOLERANCES[DTYPE]
    for seed in (1, 2, 3):
        refill(seed)
        out.fill_(float("nan"))
        graph.replay()
        expected = decode_attention_reference(q, k_cache, v_cache, table, seq_lens, SCALE, row_ids=row_ids)
        gathered = decode_attention(q, k_cache, v_cache, table[row_ids], seq_lens, SCALE)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
        torch.testing.assert_close(out, gathered, rtol=0, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,context,num_splits", [(1, 8192, 64), (4, 1000, 64), (32, 2048, None), (64, 700, 1)])
def test_repeated_replays_of_several_calls(batch, context, num_splits):
    """One graph of LAYERS calls (each with its own q and caches, all reading the batch's table
    and lengths, as a model's layers do). Per input, each of REPEATS replays equals the first
    bit for bit (a partial read before it was written would change outputs) and the outputs
    match the reference. 64 splits over 1000 keys leave most splits of every row empty; one
    split writes the output from the split kernel."""
    dev = torch.device("cuda", 0)
    req_to_token = torch.empty(batch, context, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(batch, dtype=torch.int64, device=dev)
    layers = [(torch.empty(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=dev),
               torch.empty(batch * context + 5, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev),
               torch.empty(batch * context + 5, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev))
              for _ in range(LAYERS)]

    def refill(seed: int) -> None:  # the table and lengths of the last layer's refill stay
        for i, (q, k_cache, v_cache) in enumerate(layers):
            _refill(q, k_cache, v_cache, req_to_token, seq_lens, seed * LAYERS + i)

    def step() -> list[torch.Tensor]:
        return [decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, SCALE, num_splits=num_splits)
                for q, k_cache, v_cache in layers]

    refill(seed=0)
    graph, outs = capture_cuda_graph(step)
    rtol, atol = TOLERANCES[DTYPE]
    for seed in (1, 2):
        refill(seed)
        graph.replay()
        first = [out.clone() for out in outs]
        for _ in range(REPEATS):
            for out in outs:
                out.fill_(float("nan"))
            graph.replay()
            for out, expected in zip(outs, first):
                torch.testing.assert_close(out, expected, rtol=0, atol=0)
        for (q, k_cache, v_cache), out in zip(layers, first):
            expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, SCALE)
            torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,context,num_splits,keys_per_split", [
    (1, 8192, 64, None), (7, 300, 5, None), (256, 1024, None, None), (64, 4096, 64, None), (5, 1000, None, 64)])
def test_the_split_launch_combines_as_the_combine_launch(batch, context, num_splits, keys_per_split):
    """The combine of several splits in the split launch (``combine_in_split=True``: the last program of each
    (sequence, kv head) to arrive combines its heads) against the combine launch, for rows of
    1 to 64 splits that ran (several loads of SPLITS_AT_ONCE partials), many groups arriving at
    once (256 rows), and batch-invariant mode's fixed keys per split: within bf16's tolerance
    of each other and of the reference, and every arrival counter zero after each call."""
    from arfusion.layers.kernels.triton_decode_attention import ARRIVALS

    q, k_cache, v_cache, req_to_token, seq_lens = _buffers(batch, context)
    rtol, atol = TOLERANCES[DTYPE]
    for seed in (1, 2):
        _refill(q, k_cache, v_cache, req_to_token, seq_lens, seed)
        calls = {in_split: decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, SCALE, num_splits=num_splits,
                                            keys_per_split=keys_per_split, combine_in_split=in_split)
                 for in_split in (True, False)}
        expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, SCALE)
        torch.cuda.synchronize()
        assert not ARRIVALS.get(q.device, 1).any(), "an arrival counter was left non-zero"
        torch.testing.assert_close(calls[True].float(), expected, rtol=rtol, atol=atol)
        torch.testing.assert_close(calls[True], calls[False], rtol=rtol, atol=atol)


def _torch_decode(q, k_cache, v_cache, req_to_token, seq_lens, scale):
    """The layer's torch decode path (gather + masked scaled_dot_product_attention), which
    ``Attention._decode`` uses off the GPU."""
    attention = Attention(q.shape[1], k_cache.shape[1], q.shape[2], scale)
    batch = SimpleNamespace(req_to_token=req_to_token, seq_lens=seq_lens, row_ids=None)
    return attention._decode_torch(q, k_cache, v_cache, batch)


@pytest.mark.timeout(300)
def test_print_timing_table():
    """µs per call (median over replays of a 32-call CUDA graph, full context), K+V bandwidth; the
    kernel must beat the layer's torch path at every size."""
    lines = [f"decode attention, H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} bf16, {torch.cuda.get_device_name(0)}",
             f"{'B':>4} {'context':>7} {'splits':>6} {'triton us':>10} {'GB/s':>6} {'torch us':>10} {'speedup':>7}"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    slower = []
    for batch in (1, 32, 128):
        for context in (128, 512, 2048, 8192):
            triton_us = time_decode_attention(batch, context, HEADS, KV_HEADS, HEAD_DIM, DTYPE)
            torch_us = time_decode_attention(batch, context, HEADS, KV_HEADS, HEAD_DIM, DTYPE, attention_fn=_torch_decode)
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
            splits, block = choose_launch(batch, KV_HEADS, context, sms)
            lines.append(f"{batch:>4} {context:>7} {f'{splits}x{block}':>6} {triton_us:>10.1f} {kv_bytes / triton_us / 1e3:>6.0f} "
                         f"{torch_us:>10.1f} {torch_us / triton_us:>6.1f}x")
            if not 0 < triton_us < torch_us:
                slower.append(lines[-1])
    print("\n" + "\n".join(lines))
    assert not slower, f"not faster than the torch path: {slower}"
