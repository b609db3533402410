"""The batch-invariant ops (layers/batch_invariant.py, layers/batch_invariant_attention.py and the
Triton matmul of layers/kernels/triton_bi_matmul.py under Triton's CPU interpreter): each against
its torch reference within the stated tolerances, and each row's bits the same whatever the
number of rows in the call and whatever the other rows hold. With the mode off, the layers'
matmul is ``F.linear`` itself (same bits), so the default engine's numbers are unchanged.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arfusion.layers import batch_invariant as bi
from arfusion.layers.batch_invariant_attention import attend_decode, attend_elementwise, attend_sequence
from tests.dist_utils import run_under_triton_interpreter
from tests.tolerances import TOLERANCES

ROWS = (1, 2, 3, 5, 7, 11, 16, 33, 64, 129, 256)


def _seeded(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rows_invariant(fn, x: torch.Tensor, rows=ROWS) -> list[int]:
    """The row counts M at which the first rows of ``fn(x[:M])`` differ in any bit from the same
    rows computed one at a time, and from ``fn`` on those rows followed by other random rows."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(8)])
    bad = []
    for m in rows:
        k = min(m, 8)
        mixed = torch.cat([x[:k], _seeded(m - k, *x.shape[1:], seed=m, dtype=x.dtype)]) if m > k else x[:m]
        if not (torch.equal(fn(x[:m])[:k], alone[:k]) and torch.equal(fn(mixed)[:k], alone[:k])):
            bad.append(m)
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(64, 64), (192, 64), (512, 512), (1000, 300), (2048, 896)])
def test_cpu_linear_matches_torch_and_is_row_invariant(dtype, n, k):
    w, b = _seeded(n, k, seed=1, dtype=dtype), _seeded(n, seed=2, dtype=dtype)
    x = _seeded(256, k, seed=3, dtype=dtype)
    with bi.batch_invariant_mode(True):
        out = bi.linear(x, w, b)
        assert _rows_invariant(lambda t: bi.linear(t, w, b), x) == []
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=rtol, atol=atol * 10)


def test_torch_cpu_matmul_alone_is_not_row_invariant():
    """Why the CPU path pads: torch's own matmul gives row 0 other bits at M = 1 than at M = 16
    (measured with torch 2.13, MKL); if a torch release makes it row-invariant, this fails and
    the padding can go."""
    w, x = _seeded(512, 512, seed=4), _seeded(16, 512, seed=5)
    assert not torch.equal(F.linear(x[:1], w), F.linear(x, w)[:1])


def test_mode_off_is_f_linear_and_the_mode_is_restored():
    w, x = _seeded(96, 64, seed=6), _seeded(5, 3, 64, seed=7)
    assert not bi.enabled()
    assert torch.equal(bi.linear(x, w), F.linear(x, w))
    with bi.batch_invariant_mode(True):
        assert bi.enabled() and bi.linear(x, w).shape == (5, 3, 96)
        with bi.batch_invariant_mode(False):
            assert not bi.enabled()
        assert bi.enabled()
    assert not bi.enabled()


@pytest.mark.parametrize("width", [1, 5, 64, 100, 264])
def test_tree_sum_and_log_softmax(width):
    x = _seeded(40, width, seed=width)
    torch.testing.assert_close(bi.tree_sum(x), x.sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.log_softmax(x), torch.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
    assert _rows_invariant(bi.log_softmax, x, rows=(1, 2, 7, 40)) == []


def test_tree_sum_ignores_trailing_zeros():
    """The property attention relies on: zeros appended past the last value change no bit."""
    x = _seeded(6, 37, seed=9)
    for extra in (1, 27, 91, 300):
        assert torch.equal(bi.tree_sum(F.pad(x, (0, extra))), bi.tree_sum(x))


def test_rms_norm_layer_in_batch_invariant_mode():
    from arfusion.layers.layernorm import RMSNorm

    x, w = _seeded(30, 96, seed=10), _seeded(96, seed=11)
    layer = RMSNorm(96, eps=1e-6)
    layer.weight.data.copy_(w)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    with bi.batch_invariant_mode(True), torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        assert _rows_invariant(layer, x, rows=(1, 3, 30)) == []


def _attention_reference(q, keys, values, q_pos, scale):
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1)
    v = values.repeat_interleave(group, 1)
    scores = torch.einsum("thd,nhd->htn", q, k) * scale
    visible = torch.arange(keys.shape[0])[None, :] <= q_pos[:, None]
    return torch.einsum("htn,nhd->thd", torch.softmax(scores.masked_fill(~visible, float("-inf")), -1), v)


@pytest.mark.parametrize("max_scores", [1 << 16, 1 << 24])  # a few queries per GEMM tile, or all
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 16), (14, 2, 64)])
def test_attention_matches_torch_and_rows_depend_on_their_prefix_only(max_scores, heads, kv_heads, dim):
    n = 600  # three key blocks
    q = _seeded(n, heads, dim, seed=12)
    keys, values = _seeded(n, kv_heads, dim, seed=13), _seeded(n, kv_heads, dim, seed=14)
    pos = torch.arange(n)
    out = attend_sequence(q, keys, values, pos, 0.25)
    torch.testing.assert_close(out, _attention_reference(q, keys, values, pos, 0.25), rtol=1e-5, atol=1e-5)
    # prefill chunks, single decode rows (at a block's edges too), more keys past the rows' positions
    for start, end, keys_seen in ((0, 64, 64), (64, 128, 128), (100, 101, 101), (255, 256, 256), (256, 257, 257),
                                  (599, 600, 600), (10, 20, 600), (300, 600, 600), (0, 600, 600)):
        part = attend_sequence(q[start:end], keys[:keys_seen], values[:keys_seen], pos[start:end], 0.25,
                               max_scores=max_scores)
        assert torch.equal(part, out[start:end]), (start, end, keys_seen)


@pytest.mark.parametrize("max_scores", [1, 20000, 1 << 24])
def test_a_decode_batch_gives_each_row_its_own_bits_and_a_prompt_row_the_same(max_scores):
    heads, kv_heads, dim = 8, 4, 16
    lens = [1, 40, 300, 7, 256, 257, 64]
    slots, start = [], 1
    for n in lens:
        slots.append(list(range(start, start + n)) + [0] * (max(lens) - n))
        start += n
    k_cache = _seeded(start, kv_heads, dim, seed=20)
    v_cache = _seeded(start, kv_heads, dim, seed=21)
    k_cache[0], v_cache[0] = float("nan"), 1e30  # the table's padding slot: never read into a row's result
    seq_slots, seq_lens = torch.tensor(slots), torch.tensor(lens)
    q = _seeded(len(lens), heads, dim, seed=15)
    batched = attend_decode(q, k_cache, v_cache, seq_slots, seq_lens, 0.25, max_scores)
    for i, n in enumerate(lens):
        keys, values = k_cache[seq_slots[i, :n]], v_cache[seq_slots[i, :n]]
        alone = attend_decode(q[i:i + 1], k_cache, v_cache, seq_slots[i:i + 1, :n], seq_lens[i:i + 1], 0.25)
        prompt_row = attend_sequence(q[i:i + 1], keys, values, torch.tensor([n - 1]), 0.25)
        assert torch.equal(batched[i:i + 1], alone) and torch.equal(alone, prompt_row), n
        torch.testing.assert_close(alone, _attention_reference(q[i:i + 1], keys, values, torch.tensor([n - 1]), 0.25),
                                   rtol=1e-5, atol=1e-5)


def test_the_gpu_recipe_matches_torch_and_rows_depend_on_their_prefix_only():
    """`attend_elementwise` (a CUDA device's path off the Triton kernels), run here on the CPU."""
    heads, kv_heads, dim, n = 8, 4, 16, 150
    q = _seeded(n, heads, dim, seed=12)
    keys, values = _seeded(n, kv_heads, dim, seed=13), _seeded(n, kv_heads, dim, seed=14)
    pos = torch.arange(n)
    out = attend_elementwise(q, keys, values, pos, 0.25)
    torch.testing.assert_close(out, _attention_reference(q, keys, values, pos, 0.25), rtol=1e-5, atol=1e-5)
    padded = torch.stack([F.pad(keys[:101], (0, 0, 0, 0, 0, 49), value=float("nan"))])
    part = attend_elementwise(q[100:101], padded, torch.stack([F.pad(values[:101], (0, 0, 0, 0, 0, 49))]),
                              pos[100:101], 0.25)
    assert torch.equal(part, out[100:101])


MATMUL_SHAPES = ((96, 200), (64, 1000), (130, 64))


def _interpreted_matmul(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: per (n, k) and config, the max error against torch and
    the row counts whose row 0 changes bits."""
    from arfusion.layers.kernels.triton_bi_matmul import MatmulConfig, default_config as choose_config, matmul

    results = {}
    for n, k in MATMUL_SHAPES:
        w, b, x = _seeded(n, k, seed=n), _seeded(n, seed=k), _seeded(70, k, seed=n + k)
        for splits in (1, 4):
            cfg = MatmulConfig(16, 32, 32, splits, 4, 1)
            out = matmul(x, w, b, cfg)
            error = (out - F.linear(x, w, b)).abs().max().item()
            row0 = matmul(x[:1], w, b, cfg)
            bad = [m for m in (2, 5, 17, 70) if not torch.equal(matmul(x[:m], w, b, cfg)[:1], row0)]
            results[(n, k, splits)] = (error, bad)
        results[(n, k, "chosen")] = tuple(choose_config(n, k))
    return results


@pytest.fixture(scope="module")
def interpreted_matmul():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted_matmul)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, k", MATMUL_SHAPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_matmul_matches_torch_and_is_row_invariant(interpreted_matmul, n, k, splits):
    error, bad = interpreted_matmul[(n, k, splits)]
    assert error < 1e-4 and bad == []


# a table entry whose row tile changes with M (16, then 32, then 64 rows) over one K plan
SYNTHETIC_TABLE = {"buckets": [16, 100], "configs": {"96,200": {"block_k": 32, "splits": 2, "tiles": [
    [16, 32, 4, 1], [32, 32, 2, 2], [64, 32, 4, 1]]}}}
TABLE_ROWS = (1, 7, 64, 128, 512)


def _interpreted_table(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: for every entry of the synthetic table and of the repo's
    (each K plan applied to a small 96 x 200 weight), whether rows 0-6 have the same bits at every
    M of TABLE_ROWS, and the max error. The synthetic entry takes each M's bucket tile; the repo's
    entries keep their first tile at every M: the interpreter's dot is numpy's GEMM, whose bits
    may follow the tile's row count (measured: the repo's 128-column entry differs at 64 rows),
    so there the tile changes are checked on the GPU (tests/gpu/test_bi_matmul_table.py)."""
    from arfusion.layers.kernels.bi_matmul_table import load_table, parse_table
    from arfusion.layers.kernels.triton_bi_matmul import MatmulConfig, matmul

    synthetic = list(parse_table(SYNTHETIC_TABLE).values())
    entries = synthetic + list(load_table().values())
    w, b, x = _seeded(96, 200, seed=30), _seeded(96, seed=31), _seeded(max(TABLE_ROWS), 200, seed=32)
    results = []
    for entry in dict.fromkeys(entries):
        outs = []
        for m in TABLE_ROWS:
            block_m, block_n, warps, stages = entry.tile(m if entry in synthetic else 1)
            outs.append(matmul(x[:m], w, b, MatmulConfig(block_m, block_n, entry.block_k, entry.splits, warps,
                                                         stages)))
        error = (outs[-1] - F.linear(x, w, b)).abs().max().item()
        results.append((tuple(entry), error, [m for m, o in zip(TABLE_ROWS, outs) if not torch.equal(o[:7], outs[-1][:min(m, 7)])]))
    return {"results": results}


@pytest.mark.timeout(600)
def test_every_table_config_gives_a_row_the_same_bits_at_any_batch():
    pytest.importorskip("triton")
    for entry, error, bad in run_under_triton_interpreter(_interpreted_table)["results"]:
        assert error < 1e-4 and bad == [], (entry, error, bad)


def test_the_table_fixes_the_k_plan_per_shape_and_the_tile_per_bucket(monkeypatch):
    pytest.importorskip("triton")
    from arfusion.layers.kernels import triton_bi_matmul
    from arfusion.layers.kernels.bi_matmul_table import parse_table

    monkeypatch.setattr(triton_bi_matmul, "load_table", lambda: parse_table(SYNTHETIC_TABLE))
    configs = {m: triton_bi_matmul.choose_config(96, 200, m) for m in (1, 16, 17, 100, 101, 4096)}
    assert {(c.block_k, c.splits) for c in configs.values()} == {(32, 2)}
    assert [c.block_m for c in configs.values()] == [16, 16, 32, 32, 64, 64]
    assert triton_bi_matmul.choose_config(4096, 4096, 7) == triton_bi_matmul.default_config(4096, 4096)
    with pytest.raises(ValueError, match="need 3 tiles"):
        parse_table({"buckets": [16, 100], "configs": {"1,1": {"block_k": 32, "splits": 1,
                                                               "tiles": [[16, 32, 4, 1]]}}})


def test_the_default_matmul_config_depends_on_n_and_k_only():
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_bi_matmul import MAX_SPLITS, default_config as choose_config

    decode = choose_config(4096, 4096)
    assert decode.splits > 1 and decode.splits <= MAX_SPLITS  # 64 column tiles: split K for the SMs
    assert choose_config(128256, 4096).splits == 1  # the LM head has tiles enough
    assert choose_config(4096, 256).splits == 1  # a short K is never split below MIN_SPLIT_K
