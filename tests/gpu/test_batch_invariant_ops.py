"""The batch-invariant ops on one GPU, bf16, llama3-8b shapes: the Triton matmul against cuBLAS
(tolerance) and row-invariant in bits for M = 1 ... 2048, eager and in a CUDA graph; decode
attention with fixed keys per split: a sequence's output bits the same alone and in a batch of
64 (other lengths beside it); extend attention: a prompt's rows the same whole, in chunks of
64, and batched with other prompts; a mixed step's decode rows the bits of a decode batch replayed
from a CUDA graph, its prompt rows those of an extend batch; the log-softmax and the layer's
RMSNorm row-invariant."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from arfusion.layers import batch_invariant as bi  # noqa: E402
from arfusion.layers.attention import DETERMINISTIC_KEYS_PER_SPLIT, Attention, BatchPart  # noqa: E402
from arfusion.layers.kernels.triton_bi_matmul import matmul  # noqa: E402
from arfusion.layers.layernorm import RMSNorm  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEV = torch.device("cuda", 0)
DTYPE = torch.bfloat16
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (32000, 4096))
ROWS = (1, 2, 3, 7, 8, 16, 31, 32, 64, 65, 127, 128, 129, 256, 1000, 2048)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, device=DEV)).to(DTYPE)


@pytest.mark.parametrize("n, k", SHAPES)
def test_matmul_matches_cublas_and_is_row_invariant(n, k):
    w, b = _randn(n, k, seed=1, scale=0.02), _randn(n, seed=2)
    x = _randn(max(ROWS), k, seed=3)
    out = matmul(x, w, b)
    rtol, atol = TOLERANCES[DTYPE]
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=rtol, atol=atol)
    first = matmul(x[:8], w, b)
    for m in ROWS:
        k_rows = min(m, 8)
        assert torch.equal(matmul(x[:m], w, b)[:k_rows], first[:k_rows]), f"M={m}"
    others = torch.cat([x[:8], _randn(120, k, seed=4)])
    assert torch.equal(matmul(others, w, b)[:8], first), "other rows beside them"


def test_matmul_in_a_cuda_graph_gives_the_eager_bits():
    n, k = 4096, 4096
    w, x = _randn(n, k, seed=5, scale=0.02), _randn(32, k, seed=6)
    eager = matmul(x, w)
    static = x.clone()
    matmul(static, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = matmul(static, w)
    graph.replay()
    assert torch.equal(captured, eager)


def _decode_batch(seq_lens: list[int], seed: int):
    context = max(seq_lens) + 5
    batch = len(seq_lens)
    slots = torch.randperm(batch * context, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV)
    return SimpleNamespace(is_decode=True, seq_lens=torch.tensor(seq_lens, device=DEV),
                           extend_lens=torch.ones(batch, dtype=torch.int64, device=DEV),
                           req_to_token=slots.view(batch, context), row_ids=None, max_extend_len=1)


def test_decode_attention_is_batch_invariant_with_fixed_splits():
    attention = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    lens = [300] + [1 + 37 * i for i in range(63)]
    batch = _decode_batch(lens, seed=7)
    slots = batch.req_to_token.numel()
    k_cache, v_cache = _randn(slots, KV_HEADS, HEAD_DIM, seed=8), _randn(slots, KV_HEADS, HEAD_DIM, seed=9)
    q = _randn(len(lens), HEADS * HEAD_DIM, seed=10, scale=2.0)
    alone = SimpleNamespace(**{**vars(batch), "seq_lens": batch.seq_lens[:1], "extend_lens": batch.extend_lens[:1],
                               "req_to_token": batch.req_to_token[:1]})
    with bi.batch_invariant_mode(True):
        assert max(lens) > DETERMINISTIC_KEYS_PER_SPLIT  # a row of several splits
        batched = attention.attend(q, k_cache, v_cache, batch)[:1]
        assert torch.equal(batched, attention.attend(q[:1], k_cache, v_cache, alone))


def test_extend_attention_rows_do_not_depend_on_chunks_or_batch():
    attention = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    length, other = 300, 170
    context = length + other
    table = torch.randperm(context, generator=torch.Generator(device=DEV).manual_seed(11), device=DEV)
    rows = torch.stack([table[:context], table.roll(5)])  # sequence 0: slots table[:length]
    k_cache, v_cache = _randn(context, KV_HEADS, HEAD_DIM, seed=12), _randn(context, KV_HEADS, HEAD_DIM, seed=13)
    q = _randn(length + other, HEADS * HEAD_DIM, seed=14, scale=2.0)

    def run(seq_lens, extend_lens, q_rows, req_rows):
        batch = SimpleNamespace(is_decode=False, seq_lens=torch.tensor(seq_lens, device=DEV),
                                extend_lens=torch.tensor(extend_lens, device=DEV), req_to_token=req_rows, row_ids=None,
                                max_extend_len=max(extend_lens), num_decodes=0)
        return attention.attend(q_rows, k_cache, v_cache, batch)

    with bi.batch_invariant_mode(True):
        whole = run([length], [length], q[:length], rows[:1])
        chunks = torch.cat([run([end], [end - start], q[start:end], rows[:1])
                            for start, end in zip(range(0, length, 64), [*range(64, length, 64), length])])
        batched = run([length, other], [length, other], q, rows)[:length]
    assert torch.equal(chunks, whole) and torch.equal(batched, whole)


def test_mixed_step_rows_have_the_bits_of_a_graph_decode_and_of_an_extend():
    """A mixed step (3 decodes, 2 prompt chunks; the request table read through row ids, as the
    runner does) in batch-invariant mode: its decode rows equal a decode batch of them replayed
    from a CUDA graph, its prompt rows an extend batch of the chunks alone."""
    attention = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    decode_lens, prompts = [700, 70, 5], [(40, 300), (0, 129)]  # prompts: (cached prefix, new tokens)
    seq_lens = decode_lens + [p + n for p, n in prompts]
    extend_lens = [1] * 3 + [n for _, n in prompts]
    rows, width = 16, 1024
    table = torch.randperm(rows * width, generator=torch.Generator(device=DEV).manual_seed(16), device=DEV)
    table = table.view(rows, width)
    row_ids = torch.tensor([11, 2, 7, 0, 5], device=DEV)
    k_cache, v_cache = _randn(rows * width, KV_HEADS, HEAD_DIM, seed=17), _randn(rows * width, KV_HEADS, HEAD_DIM, seed=18)
    q = _randn(sum(extend_lens), HEADS * HEAD_DIM, seed=19, scale=2.0)
    lens, news = torch.tensor(seq_lens, device=DEV), torch.tensor(extend_lens, device=DEV)
    mapping = torch.zeros(sum(extend_lens), dtype=torch.int64, device=DEV)  # unread by attend

    def batch(decode: bool, part: slice, num_decodes: int = 0) -> BatchPart:
        return BatchPart(decode, lens[part], news[part], mapping, table, row_ids[part], max(extend_lens[part]),
                         num_decodes)

    with bi.batch_invariant_mode(True):
        mixed = attention.attend(q, k_cache, v_cache, batch(False, slice(None), 3))
        prompt_rows = attention.attend(q[3:], k_cache, v_cache, batch(False, slice(3, None)))
        decodes, static_q = batch(True, slice(0, 3)), q[:3].clone()
        attention.attend(static_q, k_cache, v_cache, decodes)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = attention.attend(static_q, k_cache, v_cache, decodes)
        graph.replay()
    assert max(decode_lens) > DETERMINISTIC_KEYS_PER_SPLIT  # a decode row of several splits
    assert torch.equal(mixed[:3], graphed) and torch.equal(mixed[3:], prompt_rows)


def test_log_softmax_and_rms_norm_are_row_invariant():
    logits = _randn(64, 128256, seed=15, scale=3.0).float()
    torch.testing.assert_close(bi.log_softmax(logits), torch.log_softmax(logits, -1), rtol=1e-5, atol=1e-4)
    assert torch.equal(bi.log_softmax(logits[:1]), bi.log_softmax(logits)[:1])
    norm = RMSNorm(4096, dtype=DTYPE, device=DEV)
    x = _randn(256, 4096, seed=16)
    with bi.batch_invariant_mode(True):
        first = norm(x[:1])
        assert all(torch.equal(norm(x[:m])[:1], first) for m in (2, 7, 64, 256))
