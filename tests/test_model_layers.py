"""Tensor-parallel layers against the unsharded torch ops (2 ranks over gloo, fp32), and the
rank-independent pieces (rotary embedding, Llama-3 scaling, SiluAndMul, KV-cache attention)
against direct formulas."""
import math

import pytest
import torch
import torch.nn.functional as F

from arfusion.layers.activation import SiluAndMul
from arfusion.layers.attention import Attention
from arfusion.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    kv_head_range,
)
from arfusion.engine.models.forward_batch import ForwardBatch, KVCache
from arfusion.layers.parallel_state import get_tp_group
from arfusion.layers.rotary_embedding import RotaryEmbedding, llama3_scale_inv_freq, rope_inv_freq, scaled_inv_freq
from arfusion.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tests.dist_utils import AllReduceCounter, run_distributed
from tests.tolerances import assert_close

IN, OUT, TOKENS, HEAD_DIM = 16, 12, 5, 4


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Seeded N(0, 1), identical on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(param: torch.nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
    param.weight_loader(param, full, shard_id)


def _rank_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    size = full.shape[-1] // world
    return full[..., rank * size:(rank + 1) * size]


def _column_layers(rank: int, world: int) -> dict[str, int]:
    """Column, merged and QKV layers: each rank's output is its slice of the full output."""
    group = get_tp_group()
    counter = AllReduceCounter(group)
    x = randn(TOKENS, IN, seed=1)
    w, b = randn(OUT, IN, seed=2), randn(OUT, seed=3)
    col = ColumnParallelLinear(IN, OUT, bias=True)
    _load(col.weight, w)
    _load(col.bias, b)
    assert_close(col(x), _rank_rows(F.linear(x, w, b), rank, world))

    gate, up = randn(OUT, IN, seed=4), randn(OUT, IN, seed=5)
    merged = MergedColumnParallelLinear(IN, [OUT, OUT])
    _load(merged.weight, gate, 0)
    _load(merged.weight, up, 1)
    expected = torch.cat([_rank_rows(x @ gate.T, rank, world), _rank_rows(x @ up.T, rank, world)], dim=-1)
    assert_close(merged(x), expected)

    checked = {}
    for heads, kv_heads in [(4, 2), (4, 1)]:  # KV heads sharded, then replicated (tp 2 > 1 KV head)
        wq, wk, wv = (randn(n * HEAD_DIM, IN, seed=10 + i) for i, n in enumerate([heads, kv_heads, kv_heads]))
        bq, bk, bv = (randn(n * HEAD_DIM, seed=20 + i) for i, n in enumerate([heads, kv_heads, kv_heads]))
        qkv = QKVParallelLinear(IN, HEAD_DIM, heads, kv_heads, bias=True)
        for shard, weight, bias in [("q", wq, bq), ("k", wk, bk), ("v", wv, bv)]:
            _load(qkv.weight, weight, shard)
            _load(qkv.bias, bias, shard)
        q, k, v = qkv.split(qkv(x))
        kv_start, kv_count = kv_head_range(kv_heads, rank, world)
        kv_cols = slice(kv_start * HEAD_DIM, (kv_start + kv_count) * HEAD_DIM)
        assert_close(q, _rank_rows(F.linear(x, wq, bq), rank, world))
        assert_close(k, F.linear(x, wk, bk)[:, kv_cols])
        assert_close(v, F.linear(x, wv, bv)[:, kv_cols])
        checked[f"kv{kv_heads}"] = kv_start
    assert counter.total == 0, "column-parallel layers communicate nothing"
    return checked


def _row_layers(rank: int, world: int) -> None:
    """Row-parallel: the reduced output is the full op, bias once; unreduced, the partial sums."""
    group = get_tp_group()
    counter = AllReduceCounter(group)
    x, w, b = randn(TOKENS, IN, seed=30), randn(OUT, IN, seed=31), randn(OUT, seed=32)
    x_local = _rank_rows(x, rank, world).contiguous()
    row = RowParallelLinear(IN, OUT, bias=True, reduce_results=True)
    _load(row.weight, w)
    _load(row.bias, b)
    assert_close(row(x_local), F.linear(x, w, b))
    assert counter.total == 1

    partial_layer = RowParallelLinear(IN, OUT, bias=True, reduce_results=False)
    _load(partial_layer.weight, w)
    _load(partial_layer.bias, b)
    partial = partial_layer(x_local)
    assert counter.total == 1, "reduce_results=False must not reduce"
    own = x_local @ _rank_rows(w, rank, world).T + (b if rank == 0 else 0)
    assert_close(partial, own)
    assert_close(group.all_reduce(partial), F.linear(x, w, b))


def _vocab_layers(rank: int, world: int) -> None:
    group = get_tp_group()
    counter = AllReduceCounter(group)
    vocab, hidden = 10, 6
    table, head = randn(vocab, hidden, seed=40), randn(vocab, hidden, seed=41)
    ids = torch.tensor([0, 9, 4, 5, 3, 7, 7])  # ids of both ranks' halves, repeated
    emb = VocabParallelEmbedding(vocab, hidden)
    _load(emb.weight, table)
    before = counter.total
    assert_close(emb(ids), F.embedding(ids, table))
    assert counter.total == before + 1

    h = randn(3, hidden, seed=42)
    untied = ParallelLMHead(vocab, hidden)
    _load(untied.weight, head)
    logits = untied(h)
    assert_close(logits.gather(), h @ head.T)
    assert logits.greedy_tokens.tolist() == (h @ head.T).argmax(-1).tolist()
    tied = ParallelLMHead(vocab, hidden, tied=emb)
    assert tied.weight is emb.weight
    assert_close(tied(h).gather(), h @ table.T)


def _divisibility_errors(rank: int, world: int) -> dict[str, str]:
    cases = {
        "column": lambda: ColumnParallelLinear(IN, 5),
        "merged": lambda: MergedColumnParallelLinear(IN, [6, 5]),
        "heads": lambda: QKVParallelLinear(IN, HEAD_DIM, 3, 1),
        "kv_heads": lambda: QKVParallelLinear(IN, HEAD_DIM, 6, 3),
        "row": lambda: RowParallelLinear(5, OUT),
        "vocab": lambda: VocabParallelEmbedding(7, 4),
    }
    messages = {}
    for name, build in cases.items():
        with pytest.raises(ValueError) as err:
            build()
        messages[name] = str(err.value)
    col = ColumnParallelLinear(IN, OUT)
    with pytest.raises(ValueError) as err:
        _load(col.weight, randn(OUT, IN + 1, seed=0))
    messages["shape"] = str(err.value)
    return messages


def _all_layer_checks(rank: int, world: int) -> dict:
    kv_starts = _column_layers(rank, world)
    _row_layers(rank, world)
    _vocab_layers(rank, world)
    return {"kv_starts": kv_starts, "errors": _divisibility_errors(rank, world)}


@pytest.fixture(scope="module")
def tp2_results() -> list[dict]:
    return run_distributed(_all_layer_checks, world_size=2, timeout_s=60)


def test_parallel_layers_equal_unsharded_ops(tp2_results):
    assert [r["kv_starts"] for r in tp2_results] == [{"kv2": 0, "kv1": 0}, {"kv2": 1, "kv1": 0}]


@pytest.mark.parametrize("case,needle", [
    ("column", "output size (5)"),
    ("merged", "intermediate_size"),
    ("heads", "num_attention_heads (3)"),
    ("kv_heads", "num_key_value_heads (3)"),
    ("row", "input size (5)"),
    ("vocab", "vocab size (7)"),
    ("shape", "(12, 17)"),
])
def test_errors_are_named(tp2_results, case, needle):
    message = tp2_results[0]["errors"][case]
    assert needle in message, message
    assert case == "shape" or "tensor-parallel size (2)" in message


@pytest.mark.parametrize("total,tp,expected", [
    (8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
    (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),
    (4, 8, [(0, 1), (0, 1), (1, 1), (1, 1), (2, 1), (2, 1), (3, 1), (3, 1)]),
    (1, 2, [(0, 1), (0, 1)]),
])
def test_kv_head_range(total, tp, expected):
    assert [kv_head_range(total, r, tp) for r in range(tp)] == expected


@pytest.mark.parametrize("total,tp", [(3, 2), (2, 3), (6, 4)])
def test_kv_head_range_rejects_uneven_splits(total, tp):
    with pytest.raises(ValueError, match="not divisible"):
        kv_head_range(total, 0, tp)


def _direct_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pair (x_i, x_{i+d/2}) as the complex number x_i + 1j x_{i+d/2}, times exp(1j p inv_freq_i)."""
    tokens, width = x.shape
    heads = x.double().view(tokens, -1, inv_freq.numel() * 2)
    half = inv_freq.numel()
    z = torch.complex(heads[..., :half], heads[..., half:])
    angle = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([rotated.real, rotated.imag], dim=-1).view(tokens, width)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("theta,scaling", [(10000.0, None), (500000.0, LLAMA3), (1e6, {"rope_type": "default"})])
def test_rotary_matches_direct_formula(theta, scaling):
    head_dim, heads, kv_heads = 16, 4, 2
    rope = RotaryEmbedding(head_dim, theta, scaling)
    positions = torch.tensor([0, 1, 7, 100, 4095, 70000])
    q, k = randn(6, heads * head_dim, seed=50), randn(6, kv_heads * head_dim, seed=51)
    q_out, k_out = rope(positions, q, k)
    inv_freq = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if scaling and scaling["rope_type"] == "llama3":
        inv_freq = [_llama3_one(f, scaling) for f in inv_freq]
    inv = torch.tensor(inv_freq, dtype=torch.float64)
    # fp32 angles (as HF and vLLM compute them) are off by up to ~position * 2**-24 rad:
    # ~4e-3 rad at position 70000; a wrong pairing or frequency is off by O(1)
    for out, x in [(q_out, q), (k_out, k)]:
        torch.testing.assert_close(out.double(), _direct_rope(x, positions, inv), rtol=0, atol=2e-3)


def _llama3_one(freq: float, s: dict) -> float:
    """Llama-3 scaling of one frequency, written out branch by branch."""
    wavelen = 2 * math.pi / freq
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    if wavelen < high_wavelen:
        return freq
    if wavelen > low_wavelen:
        return freq / s["factor"]
    smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"])
    return (1 - smooth) * freq / s["factor"] + smooth * freq


def test_llama3_scaling_matches_formula_in_every_band():
    inv_freq = rope_inv_freq(128, 500000.0)
    scaled = llama3_scale_inv_freq(inv_freq, LLAMA3)
    expected = torch.tensor([_llama3_one(f, LLAMA3) for f in inv_freq.tolist()])
    torch.testing.assert_close(scaled, expected, rtol=1e-5, atol=0)
    ratio = (inv_freq / scaled).tolist()
    assert ratio[0] == 1.0, "the highest frequency is kept"
    assert ratio[-1] == pytest.approx(8.0), "the lowest frequency is divided by the factor"
    assert any(1.0 < r < 8.0 for r in ratio), "some frequencies are blended"


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="dynamic"):
        scaled_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0})


def test_silu_and_mul():
    x = randn(3, 10, seed=60)
    assert_close(SiluAndMul()(x), x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:])


def _naive_attention(q, k, v, heads, kv_heads, query_pos):
    """Per head: softmax(q k^T / sqrt(d)) v over keys 0..query_pos, KV head h // (heads/kv_heads)."""
    d = q.shape[-1] // heads
    q, k, v = q.view(-1, heads, d), k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    out = torch.empty_like(q)
    for t, p in enumerate(query_pos):
        for h in range(heads):
            kh = h // (heads // kv_heads)
            weights = torch.softmax(k[:p + 1, kh] @ q[t, h] / math.sqrt(d), dim=0)
            out[t, h] = weights @ v[:p + 1, kh]
    return out.view(len(query_pos), -1)


def test_attention_over_kv_cache_extend_then_decode():
    """Two sequences in scattered slots: a prefill, a chunk after a cached prefix mixed with a
    decode, then a padded-width decode; each against naive attention over the whole sequence."""
    heads, kv_heads, d = 4, 2, 8
    attn = Attention(heads, kv_heads, d, d ** -0.5)
    cache = KVCache.allocate(64, 1, kv_heads, d, torch.float32)
    lengths = [9, 4]
    q_all = [randn(n + 1, heads * d, seed=70 + i) for i, n in enumerate(lengths)]
    k_all = [randn(n + 1, kv_heads * d, seed=80 + i) for i, n in enumerate(lengths)]
    v_all = [randn(n + 1, kv_heads * d, seed=90 + i) for i, n in enumerate(lengths)]
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
    seq_slots = [slots[:10], slots[10:15]]
    # (sequence, first new token, new tokens) per step
    steps = [[(0, 0, 5), (1, 0, 4)], [(0, 5, 4), (1, 4, 1)], [(0, 9, 1)]]
    for step in steps:
        width = 16 if len(step) == 1 else None
        batch = ForwardBatch.from_lists(
            [[0] * n for _, _, n in step], [seq_slots[s][:start + n] for s, start, n in step], max_context=width
        )
        q, k, v = (torch.cat([t[s][start:start + n] for s, start, n in step]) for t in (q_all, k_all, v_all))
        out = attn(q, k, v, cache.k[0], cache.v[0], batch)
        expected = torch.cat([
            _naive_attention(q_all[s][start:start + n], k_all[s][:start + n], v_all[s][:start + n], heads, kv_heads,
                             list(range(start, start + n)))
            for s, start, n in step
        ])
        assert batch.is_decode == (len(step) == 1)
        assert_close(out, expected)


@pytest.mark.parametrize("new_tokens", [[[1], [1], [1]], [[1, 1], [1], [1, 1, 1]]], ids=["decode", "extend"])
def test_attention_reads_sequence_rows_through_row_ids(new_tokens):
    """A batch whose sequences' slots sit in rows ``row_ids`` of a larger table (the other rows
    random slots) attends exactly as the batch with those rows gathered."""
    heads, kv_heads, d, num_slots, width = 4, 2, 8, 64, 16
    attn = Attention(heads, kv_heads, d, d ** -0.5)
    k_cache, v_cache = randn(num_slots, kv_heads, d, seed=100), randn(num_slots, kv_heads, d, seed=101)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(102)).tolist()
    gathered = ForwardBatch.from_lists(new_tokens, [slots[:9], slots[9:14], slots[14:30]], max_context=width)
    row_ids = torch.tensor([5, 1, 3])
    table = torch.randint(0, num_slots, (7, width), generator=torch.Generator().manual_seed(103))
    table[row_ids] = gathered.req_to_token
    indexed = ForwardBatch(gathered.forward_mode, gathered.input_ids, gathered.positions, gathered.seq_lens,
                           gathered.extend_lens, gathered.slot_mapping, table, row_ids)
    q = randn(gathered.num_tokens, heads * d, seed=104)
    out = attn.attend(q, k_cache, v_cache, indexed)
    assert torch.equal(out, attn.attend(q, k_cache, v_cache, gathered))
    table[row_ids] = torch.randint(0, num_slots, (3, width), generator=torch.Generator().manual_seed(105))
    assert not torch.equal(attn.attend(q, k_cache, v_cache, indexed), out), "the rows were not read"
