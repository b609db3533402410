"""The Triton decode attention's one-launch path (a ``counter`` given: the last split of each
(sequence, kv head) combines its heads) under Triton's CPU interpreter, in one spawned child with
TRITON_INTERPRET=1 (skipped without triton).

Per case: random q, k, v (fp32 or fp16), rows of one batch running one split (short) and many
(long). The one-launch call matches the fp32 reference (decode_attention_reference, or with
sinks / a window layers/sink_attention.py's torch path) within tests/tolerances.py's
TOLERANCES, and equals the two-launch call (no counter) bit for bit: both run the same combine
code (`_combine_head`) on the same partials in the same order. The combine kernel is not
launched, the counter's B * KVH entries are zero again afterwards and the entries past them
untouched, and a second call on the same counter gives the same bits. New float tensors start
as NaN meanwhile, so a partial read before its split wrote it would show.

The interpreter runs the programs one after another, so the arrival order and the atomics'
memory ordering are checked on a GPU only (tests/gpu/test_triton_decode_attention.py).
"""
import contextlib
import re
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.kernels.triton_decode_attention import decode_attention  # noqa: E402
from tests.attention_cases import PAD_SLOT, spread_rows  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

GUARD = 7  # what the counter entries past B * KVH hold: the launch must leave them alone

# (name, dtype, group, kv_heads, head_dim, seq_lens, options); the width C is the longest length
CASES = [
    ("chosen splits", torch.float32, 4, 2, 32, (700,), {}),  # 11 splits of 64 keys (132 nominal SMs)
    ("short and long", torch.float16, 2, 2, 64, (1, 64, 520), {"num_splits": 8}),
    ("many empty splits", torch.float32, 2, 2, 64, (1, 2, 64, 130, 700, 700), {"num_splits": 64}),
    ("one head per kv head", torch.float32, 1, 4, 64, (300, 5), {"num_splits": 3}),
    ("row ids", torch.float16, 4, 2, 64, (1, 300, 77, 150, 2), {"num_splits": 5, "row_ids": True}),
    ("keys per split", torch.float32, 2, 2, 32, (1, 63, 65, 300), {"keys_per_split": 64, "block": 16}),
    ("sinks and window", torch.float32, 2, 2, 32, (3, 40, 200), {"num_splits": 4, "block": 16, "window": 70,
                                                                  "sinks": True}),
    ("sinks, window, keys per split", torch.float16, 4, 2, 32, (1, 50, 260), {"keys_per_split": 32, "block": 16,
                                                                               "window": 50, "sinks": True}),
]


def _case(dtype, group, kv_heads, dim, lens, seed):
    """q, caches and a ``[B, C]`` table (C the longest length) of random distinct slots, padded
    with PAD_SLOT past each length; never zeros."""
    g = torch.Generator().manual_seed(seed)
    batch, heads, context = len(lens), group * kv_heads, max(lens)
    num_slots = batch * context + 5
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype)
    req_to_token = torch.full((batch, context), PAD_SLOT, dtype=torch.int64)
    for b, n in enumerate(lens):
        req_to_token[b, :n] = torch.randperm(num_slots, generator=g)[:n]
    sinks = 2 * torch.randn(heads, generator=g)
    return q, k_cache, v_cache, req_to_token, torch.tensor(lens), sinks


def _reference(q, k_cache, v_cache, req_to_token, seq_lens, scale, sinks, window):
    """fp32 ``[B, H, D]``: each row's softmax over its own keys (sink and window as given)."""
    from arfusion.layers.sink_attention import attend_with_sinks

    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        slots = req_to_token[b, :n]
        rows.append(attend_with_sinks(q[b:b + 1].float(), k_cache[slots].float(), v_cache[slots].float(),
                                      torch.tensor([n - 1]), scale, sinks, window)[0])
    return torch.stack(rows)


@contextlib.contextmanager
def _nan_filled_empty():
    """``torch.empty`` of a float dtype fills with NaN while inside: a partial or output read
    before it was written shows (the allocator would otherwise hand back the last call's memory,
    which may hold the very values expected)."""
    empty = torch.empty

    def filled(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    with mock.patch.object(torch, "empty", filled):
        yield


class _NoLaunch:
    """Stands in for the combine kernel during one-launch calls: a launch fails the case."""

    def __getitem__(self, grid):
        raise AssertionError(f"the combine kernel was launched (grid {grid}) on the one-launch path")


def _interpreted(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: per case name, its checks (name -> failure message or None)."""
    import triton

    import arfusion.layers.kernels.triton_decode_attention as attn

    assert triton.knobs.runtime.interpret, "the child must run the interpreter"
    results = {}
    for seed, (name, dtype, group, kv_heads, dim, lens, options) in enumerate(CASES):
        q, k_cache, v_cache, req_to_token, seq_lens, sinks = _case(dtype, group, kv_heads, dim, lens, seed)
        options = dict(options)
        table, row_ids = (spread_rows(req_to_token, spare=3, seed=seed) if options.pop("row_ids", False)
                          else (req_to_token, None))
        if not options.pop("sinks", False):
            sinks = None
        window, scale = options.get("window", 0), dim ** -0.5
        rows = len(lens) * kv_heads
        counter = torch.full((rows + 3,), GUARD, dtype=torch.int32)
        counter[:rows] = 0

        def call(with_counter: bool) -> torch.Tensor:
            return decode_attention(q, k_cache, v_cache, table, seq_lens, scale, row_ids=row_ids, sinks=sinks,
                                    counter=counter if with_counter else None, **options)

        with _nan_filled_empty():
            two_launches = call(False)
            with mock.patch.object(attn, "_combine_kernel", _NoLaunch()):
                first, second = call(True), call(True)
        expected = _reference(q, k_cache, v_cache, req_to_token, seq_lens, scale, sinks, window)
        checks = {}
        try:
            torch.testing.assert_close(first.float(), expected, rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1])
            checks["reference"] = None
        except AssertionError as e:
            checks["reference"] = str(e)
        checks["two launches"] = None if torch.equal(first, two_launches) else (
            f"differs from the two-launch path by {(first.float() - two_launches.float()).abs().max().item():.3g}")
        checks["second call"] = None if torch.equal(second, first) else "a second call gave other bits"
        checks["counter"] = None if counter[:rows].eq(0).all() and counter[rows:].eq(GUARD).all() else (
            f"counter after the calls: {counter.tolist()}")
        results[name] = checks
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [case[0] for case in CASES])
@pytest.mark.parametrize("check", ["reference", "two launches", "second call", "counter"])
def test_one_launch(interpreted, name, check):
    assert interpreted[name][check] is None, interpreted[name][check]


def test_bad_counters_raise_clear_errors():
    q, k_cache, v_cache, req_to_token, seq_lens, _ = _case(torch.float32, 2, 2, 16, (5, 9), seed=0)
    rows = 2 * 2
    bad = {
        "must be int32, not torch.int64": torch.zeros(rows, dtype=torch.int64),
        "must be on cpu, not meta": torch.zeros(rows, dtype=torch.int32, device="meta"),
        "must be contiguous": torch.zeros(rows, 2, dtype=torch.int32)[:, 0],
        f"must hold at least B * KVH = {rows} entries, not {rows - 1}": torch.zeros(rows - 1, dtype=torch.int32),
    }
    for message, counter in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, 0.25, num_splits=2, counter=counter)
