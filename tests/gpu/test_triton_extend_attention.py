"""The Triton extend (prefill) attention on one GPU, bf16, llama3-8b TP2 shapes (16 query heads,
4 KV heads, head_dim 128): against the fp32 torch reference and the layer's per-sequence torch
path, through row ids, captured in a CUDA graph (with ``max_extend_len`` the call has no host
sync); then a timing table against the layer's torch path (run with ``-s`` to see it; the
timing is informational, not asserted)."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from arfusion.benchmarks.kernels.attention_timing import time_extend_attention  # noqa: E402
from arfusion.layers.attention import Attention  # noqa: E402
from arfusion.layers.kernels.triton_extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

pytestmark = pytest.mark.gpus(1)

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5

# (cached prefix lengths, new token counts) per sequence
BATCHES = {
    "8x512-prefill": ([0] * 8, [512] * 8),
    "8-cached-prefixes": ([0, 1, 100, 511, 1024, 2000, 4000, 7], [512, 1, 300, 17, 512, 64, 200, 1000]),
}


def _make(prefix_lens: list[int], extend_lens: list[int], seed: int):
    """``(q [T, H, D], k_cache, v_cache, req_to_token [B, C], seq_lens, extend_lens)`` on cuda:0:
    q scaled so the softmax is peaked, every sequence's slots scattered over the cache."""
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch, context = len(seq_lens), max(seq_lens)
    num_slots = batch * context + 5
    q = 2 * torch.randn(sum(extend_lens), HEADS, HEAD_DIM, generator=gen, device=dev).to(DTYPE)
    k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen, device=dev).to(DTYPE)
    v_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen, device=dev).to(DTYPE)
    req_to_token = torch.randperm(num_slots, generator=gen, device=dev)[:batch * context].view(batch, context)
    return (q, k_cache, v_cache, req_to_token, torch.tensor(seq_lens, device=dev),
            torch.tensor(extend_lens, device=dev))


def _torch_extend(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, scale):
    """The layer's per-sequence torch extend path (``Attention._extend_torch``: one masked
    scaled_dot_product_attention per sequence, lengths read on the host)."""
    attention = Attention(q.shape[1], k_cache.shape[1], q.shape[2], scale)
    batch = SimpleNamespace(is_decode=False, seq_lens=seq_lens, extend_lens=extend_lens, req_to_token=req_to_token,
                            row_ids=None, max_extend_len=None)
    return attention._extend_torch(q, k_cache, v_cache, batch)


def _assert_matches(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.isfinite(out).all(), what
    rel_l2 = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel_l2 < 1e-2, f"{what}: relative L2 error {rel_l2:.2e}"
    torch.testing.assert_close(out.float(), expected, rtol=TOLERANCES[DTYPE][0], atol=TOLERANCES[DTYPE][1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", BATCHES)
def test_matches_reference_and_torch_path(name):
    """Against the fp32 reference and the layer's torch path; the grid sized from a host
    ``max_extend_len`` gives the same bits."""
    prefix_lens, extend_lens = BATCHES[name]
    args = _make(prefix_lens, extend_lens, seed=1)
    out = extend_attention(*args, SCALE)
    expected = extend_attention_reference(*args, SCALE)
    _assert_matches(out, expected, "triton vs reference")
    _assert_matches(_torch_extend(*args, SCALE), expected, "torch path vs reference")
    torch.testing.assert_close(extend_attention(*args, SCALE, max_extend_len=max(extend_lens)), out, rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_row_ids_read_rows_of_a_larger_table():
    """Sequence i reads row ``row_ids[i]`` of a table of 2B + 1 rows: as the reference and, bit
    for bit, as the call on the gathered rows."""
    q, k_cache, v_cache, req_to_token, seq_lens, extend_lens = _make(*BATCHES["8-cached-prefixes"], seed=2)
    gen = torch.Generator(device=q.device).manual_seed(3)
    batch = req_to_token.shape[0]
    table = req_to_token[torch.randint(0, batch, (2 * batch + 1,), generator=gen, device=q.device)]
    row_ids = torch.randperm(table.shape[0], generator=gen, device=q.device)[:batch]
    table[row_ids] = req_to_token
    out = extend_attention(q, k_cache, v_cache, table, seq_lens, extend_lens, SCALE, row_ids=row_ids)
    expected = extend_attention_reference(q, k_cache, v_cache, table, seq_lens, extend_lens, SCALE, row_ids=row_ids)
    _assert_matches(out, expected, "row_ids vs reference")
    gathered = extend_attention(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, SCALE)
    torch.testing.assert_close(out, gathered, rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_graph_replay_with_new_lengths():
    """Captured once with ``max_extend_len`` (no host sync), replayed with new contents and new
    (prefix, new) splits of the same T tokens: each replay equals the reference and, bit for
    bit, the eager call."""
    splits = [([0, 0, 0, 0], [256, 256, 256, 256]), ([300, 0, 1, 2000], [1000, 22, 1, 1]),
              ([5, 6, 7, 8], [1, 1, 1, 1021])]
    bound = max(max(e) for _, e in splits)
    context = max(p + e for prefix, new in splits for p, e in zip(prefix, new))
    static = _make([context - 256] * 4, [256] * 4, seed=4)  # the widest table, T = 1024
    q, k_cache, v_cache, req_to_token, seq_lens, extend_lens = static

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        extend_attention(*static, SCALE, max_extend_len=bound)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = extend_attention(*static, SCALE, max_extend_len=bound)

    for seed, (prefix_lens, new_lens) in enumerate(splits, start=5):
        fresh = _make(prefix_lens, new_lens, seed)
        for dst, src in zip((q, k_cache, v_cache), fresh[:3]):
            dst[:src.shape[0]].copy_(src)  # a smaller cache fills the first slots
        req_to_token[:, :fresh[3].shape[1]].copy_(fresh[3])
        seq_lens.copy_(fresh[4])
        extend_lens.copy_(fresh[5])
        out.fill_(float("nan"))  # every row must be written by the replay
        graph.replay()
        expected = extend_attention_reference(*static, SCALE)
        _assert_matches(out, expected, f"replay {seed}")
        torch.testing.assert_close(out, extend_attention(*static, SCALE), rtol=0, atol=0)


# label: (cached prefix lengths, new token counts)
TIMED = {
    "1 x 512": ([0], [512]),
    "1 x 4096": ([0], [4096]),
    "8 x 512": ([0] * 8, [512] * 8),
    "32 x 128": ([0] * 32, [128] * 32),
    "4 x (4096 + 512)": ([4096] * 4, [512] * 4),
    "8 mixed prefixes": BATCHES["8-cached-prefixes"],
    "64 x (1024 + 1)": ([1024] * 64, [1] * 64),
}


@pytest.mark.timeout(600)
def test_print_timing_table():
    """µs per eager call (median of 10 trials of 8 calls) of the kernel and the layer's torch
    path, and the kernel's attention TFLOP/s (4 * H * D flops per visible (query, key) pair).
    Informational: only checks that both ran."""
    lines = [f"extend attention, H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} bf16, {torch.cuda.get_device_name(0)}",
             f"{'batch (prefix + new)':>22} {'tokens':>6} {'triton us':>10} {'TFLOP/s':>7} {'torch us':>10} "
             f"{'speedup':>7}"]
    for label, (prefix_lens, extend_lens) in TIMED.items():
        triton_us = time_extend_attention(prefix_lens, extend_lens, HEADS, KV_HEADS, HEAD_DIM, DTYPE)
        torch_us = time_extend_attention(prefix_lens, extend_lens, HEADS, KV_HEADS, HEAD_DIM, DTYPE,
                                         attention_fn=_torch_extend)
        pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens))
        tflops = 4 * HEADS * HEAD_DIM * pairs / triton_us / 1e6
        lines.append(f"{label:>22} {sum(extend_lens):>6} {triton_us:>10.1f} {tflops:>7.1f} {torch_us:>10.1f} "
                     f"{torch_us / triton_us:>6.1f}x")
        assert triton_us > 0 and torch_us > 0, lines[-1]
    print("\n" + "\n".join(lines))
