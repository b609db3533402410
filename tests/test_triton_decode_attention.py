"""The Triton decode-attention kernels under Triton's CPU interpreter, against the fp32 torch
reference (gather + masked softmax).

Skipped when triton is not installed (CI installs only the base and test extras). The
interpreter must be chosen before triton is imported (its own ``tl.sum``, ``tl.cdiv``... are
``@triton.jit`` functions built at import), so the kernel cases run in one spawned process whose
environment has TRITON_INTERPRET=1 (``run_distributed`` with one rank: a hard timeout and the
child's traceback on failure); this process keeps compiled kernels for any GPU test beside it.
Each parametrized test then checks its own case's result. Host-side checks run here directly.

bf16 is checked on the GPU only (tests/gpu/test_triton_decode_attention.py): the interpreter
stores bf16 as uint16 and its ``tl.dot`` multiplies those bit patterns (triton's debugging guide
says the interpreter does not support bf16 operations; triton-lang/triton#11584).
"""
import functools
import re

import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.kernels.triton_decode_attention import (  # noqa: E402
    ARRIVALS,
    COMBINE_IN_SPLIT_MIN_GROUP,
    choose_launch,
    decode_attention,
    decode_attention_reference,
    plan_splits,
)
from tests.attention_cases import PAD_SLOT, result_checker, spread_rows  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402



def make_case(batch: int, group: int, kv_heads: int, dim: int, context: int, dtype: torch.dtype,
              index_dtype: torch.dtype, seed: int, strided_q: bool = False):
    """Random q and caches, each row's slots a random subset of the cache, ragged seq_lens (the
    last row at the full width, the first at 1 when there are two rows or more), rows padded
    with PAD_SLOT past seq_len."""
    g = torch.Generator().manual_seed(seed)
    heads = group * kv_heads
    num_slots = batch * context + 7
    if strided_q:  # q as a view of a packed [B, (H + 2 KVH) * D] qkv projection
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        q = qkv[:, :heads * dim].view(batch, heads, dim)
    else:
        q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype)
    seq_lens = torch.randint(1, context + 1, (batch,), generator=g)
    seq_lens[-1] = context
    if batch > 1:
        seq_lens[0] = 1
    req_to_token = torch.full((batch, context), PAD_SLOT, dtype=torch.int64)
    for b in range(batch):
        n = int(seq_lens[b])
        req_to_token[b, :n] = torch.randperm(num_slots, generator=g)[:n]
    return q, k_cache, v_cache, req_to_token.to(index_dtype), seq_lens.to(index_dtype)


# (batch, group, kv_heads, head_dim, context, dtype, index dtype, num_splits); None: the shape-based choice
CASES = [
    (1, 1, 4, 64, 200, torch.float32, torch.int64, None),
    (1, 4, 4, 128, 700, torch.float16, torch.int64, None),
    (3, 2, 4, 64, 300, torch.float16, torch.int64, 5),
    (3, 4, 2, 128, 520, torch.float32, torch.int32, None),
    (3, 8, 1, 128, 150, torch.float16, torch.int32, 1),
    (4, 2, 2, 64, 200, torch.float32, torch.int64, 1),  # one split over several key blocks: out written directly
    (8, 1, 2, 128, 90, torch.float32, torch.int64, 3),
    (8, 4, 4, 128, 260, torch.float16, torch.int64, None),
    (8, 8, 2, 64, 400, torch.float32, torch.int64, 7),
    (3, 4, 4, 64, 1100, torch.float16, torch.int64, 64),
]

# (batch, group, kv_heads, head_dim, context, dtype, index dtype, num_splits, block): 128-key blocks
BLOCK_CASES = [
    (2, 4, 2, 64, 300, torch.float16, torch.int64, 2, 128),  # chunks of 256 keys: two blocks, then one partial
    (3, 2, 2, 64, 200, torch.float32, torch.int32, 1, 128),  # one split: out written directly
    (16, 1, 4, 64, 150, torch.float32, torch.int64, None, None),  # 64 rows: the mid-size choice, (2, 128)
]

REPLAY_LENS = ([330, 1, 65, 64], [2, 330, 329, 128])

# (dtype, num_splits, seq_lens) at B=6, G=2, KVH=2, D=64, C=700: every row runs fewer splits than
# NUM_SPLITS (8 splits: ceil(n / chunk) = 1, 1, 2, 3, 5, 6; 64 splits: 1, 1, 1, 3, 11, 11), so
# the combine must read only the splits that ran
SHORT_ROW_CASES = [
    (torch.float32, 8, (1, 64, 65, 129, 520, 700)),
    (torch.float16, 64, (1, 2, 64, 130, 700, 700)),
]

# (batch, group, kv_heads, head_dim, context, dtype, index dtype, num_splits, keys_per_split): the
# combine in the split launch against its launch of its own, with rows that one
# split covers (seq_len 1) beside rows of several
COMBINE_CASES = [
    (3, 4, 2, 64, 300, torch.float32, torch.int64, 5, None),
    (6, 8, 1, 64, 700, torch.float16, torch.int64, 64, None),
    (5, 2, 2, 16, 300, torch.float32, torch.int64, None, 64),
]

# (batch, group, kv_heads, head_dim, context, dtype, index dtype, num_splits) read through row ids
ROW_ID_CASES = [
    (1, 4, 2, 64, 70, torch.float16, torch.int64, None),
    (3, 4, 2, 64, 300, torch.float16, torch.int64, 5),
    (4, 2, 2, 128, 130, torch.float32, torch.int32, None),
]


def _interpreted_cases(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: every CASES entry, then the replay check. Returns per
    key None when the kernel matched the reference, else the assertion message."""
    import triton

    assert triton.knobs.runtime.interpret, "the child must run the interpreter"
    results = {}
    check = result_checker(results)

    for case in CASES:
        batch, group, kv_heads, dim, context, dtype, index_dtype, num_splits = case
        q, k_cache, v_cache, req_to_token, seq_lens = make_case(
            batch, group, kv_heads, dim, context, dtype, index_dtype, seed=batch * 100 + group * 10 + dim)
        scale = dim ** -0.5
        out = decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, scale, num_splits=num_splits)
        assert out.shape == q.shape and out.dtype == dtype, (out.shape, out.dtype)
        expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, scale)
        rtol, atol = TOLERANCES[dtype]
        check(case, out.float(), expected, rtol, atol)
        if batch > 1:  # seq_len 1: the softmax of one key is 1, so the output is that key's value row
            v0 = v_cache[req_to_token[0, 0].long()].float().repeat_interleave(group, dim=0)
            check((case, "seq_len 1"), out[0].float(), v0, rtol, atol)

    for case in BLOCK_CASES:
        batch, group, kv_heads, dim, context, dtype, index_dtype, num_splits, block = case
        q, k_cache, v_cache, req_to_token, seq_lens = make_case(
            batch, group, kv_heads, dim, context, dtype, index_dtype, seed=batch * 100 + group * 10 + dim + 2)
        out = decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, 0.3, num_splits=num_splits, block=block)
        expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, 0.3)
        check(case, out.float(), expected, *TOLERANCES[dtype])

    for case in ROW_ID_CASES:
        batch, group, kv_heads, dim, context, dtype, index_dtype, num_splits = case
        q, k_cache, v_cache, req_to_token, seq_lens = make_case(
            batch, group, kv_heads, dim, context, dtype, index_dtype, seed=batch * 100 + group * 10 + dim + 1)
        table, row_ids = spread_rows(req_to_token, spare=3, seed=batch)
        out = decode_attention(q, k_cache, v_cache, table, seq_lens, 0.3, num_splits=num_splits, row_ids=row_ids)
        expected = decode_attention_reference(q, k_cache, v_cache, table, seq_lens, 0.3, row_ids=row_ids)
        check((case, "row_ids"), out.float(), expected, *TOLERANCES[dtype])
        gathered = decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, 0.3, num_splits=num_splits)
        check((case, "row_ids = gathered rows"), out, gathered, 0, 0)

    # q as a view into a packed qkv projection; the same buffers and num_splits with other
    # seq_lens (what a CUDA-graph replay does) must give the new rows' attention
    q, k_cache, v_cache, req_to_token, seq_lens = make_case(4, 4, 2, 64, 330, torch.float32, torch.int64,
                                                            seed=7, strided_q=True)
    assert not q.is_contiguous()
    req_to_token[req_to_token == PAD_SLOT] = 0  # fill the pads: any length up to the width is valid
    for lens in REPLAY_LENS:
        lens = torch.tensor(lens)
        out = decode_attention(q, k_cache, v_cache, req_to_token, lens, 0.3, num_splits=6)
        expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, lens, 0.3)
        check(("replay", tuple(lens.tolist())), out, expected, 1e-5, 1e-5)

    for case in SHORT_ROW_CASES:
        dtype, num_splits, lens = case
        q, k_cache, v_cache, req_to_token, _ = make_case(6, 2, 2, 64, 700, dtype, torch.int64, seed=num_splits)
        req_to_token[req_to_token == PAD_SLOT] = 0
        lens = torch.tensor(lens)
        out = decode_attention(q, k_cache, v_cache, req_to_token, lens, 0.3, num_splits=num_splits)
        expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, lens, 0.3)
        check(case, out.float(), expected, *TOLERANCES[dtype])

    for case in COMBINE_CASES:
        batch, group, kv_heads, dim, context, dtype, index_dtype, num_splits, keys_per_split = case
        q, k_cache, v_cache, req_to_token, seq_lens = make_case(
            batch, group, kv_heads, dim, context, dtype, index_dtype, seed=batch * 100 + group * 10 + dim + 3)
        call = functools.partial(decode_attention, q, k_cache, v_cache, req_to_token, seq_lens, 0.3,
                                 num_splits=num_splits, keys_per_split=keys_per_split,
                                 block=16 if keys_per_split else None)
        one_launch, again, two_launches = call(combine_in_split=True), call(combine_in_split=True), call(
            combine_in_split=False)
        expected = decode_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, 0.3)
        check((case, "reference"), one_launch.float(), expected, *TOLERANCES[dtype])
        # batch-invariant mode: the same sums in the same order either way (no FMA in the interpreter)
        check((case, "combine launch"), one_launch.float(), two_launches.float(),
              *((0, 0) if keys_per_split else TOLERANCES[dtype]))
        check((case, "again"), again, one_launch, 0, 0)
        results[(case, "counters")] = (None if not ARRIVALS.get(q.device, 1).any() else
                                       "an arrival counter was left non-zero")
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted_cases)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_matches_fp32_reference(interpreted, case):
    assert interpreted[case] is None, interpreted[case]
    if case[0] > 1:
        assert interpreted[(case, "seq_len 1")] is None, interpreted[(case, "seq_len 1")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lens", REPLAY_LENS)
def test_strided_q_and_new_seq_lens_with_fixed_splits(interpreted, lens):
    key = ("replay", tuple(lens))
    assert interpreted[key] is None, interpreted[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_128_key_blocks(interpreted, case):
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("case", ROW_ID_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_row_ids_read_rows_of_a_larger_table(interpreted, case):
    """Row b reads ``req_to_token[row_ids[b]]``: as the reference, and bit for bit as the call
    with those rows gathered."""
    for key in ((case, "row_ids"), (case, "row_ids = gathered rows")):
        assert interpreted[key] is None, interpreted[key]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", COMBINE_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_the_split_launch_combines_its_splits(interpreted, case):
    """With several splits the split launch's last program of each (sequence, kv head) combines
    them (``combine_in_split=True``): as the reference, as the combine launch within the dtype's tolerance (the
    sums' order differs; batch-invariant mode adds in split order in both), the same bits on a
    second call, and every arrival counter back at zero after each call."""
    for key in ((case, "reference"), (case, "combine launch"), (case, "again"), (case, "counters")):
        assert interpreted[key] is None, interpreted[key]


@pytest.mark.parametrize("group", [1, 2, 4, 7, 8, 16])
def test_the_group_size_chooses_where_several_splits_combine(group):
    """By default several splits combine in the split launch (arrival counters planned) where a
    kv head serves at least COMBINE_IN_SPLIT_MIN_GROUP query heads, else in the combine launch
    (none); ``combine_in_split`` overrides either way; one split needs neither."""
    from arfusion.layers.kernels.triton_decode_attention import plan_splits

    q = torch.empty(2, 2 * group, 64)
    in_split = group >= COMBINE_IN_SPLIT_MIN_GROUP
    assert (plan_splits(q, 2, 1024, 4, None, None).arrivals is not None) is in_split
    assert plan_splits(q, 2, 1024, 4, None, None, combine_in_split=True).arrivals is not None
    assert plan_splits(q, 2, 1024, 4, None, None, combine_in_split=False).arrivals is None
    assert plan_splits(q, 2, 1024, 1, None, None, combine_in_split=True).arrivals is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", SHORT_ROW_CASES, ids=lambda c: f"{str(c[0]).replace('torch.', '')}-{c[1]}splits")
def test_rows_shorter_than_the_splits(interpreted, case):
    """Rows whose later splits are empty: the combine merges only the splits that ran."""
    assert interpreted[case] is None, interpreted[case]


FIXED_SPLIT_BATCHES = (1, 7, 64)


def _interpreted_fixed_splits(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: batch-invariant mode's fixed keys per split (64 keys, 16-key
    blocks). The last row (300 keys: 5 splits) alone, among the last 7 rows and among 64, each
    with the table as wide as the batch's longest row (as an eager step gathers it) and 40 wider
    (as a CUDA graph's table): its output and whether each equals the first bit for bit. The
    other rows hold up to 64 keys (one split each: the interpreter runs every program)."""
    q, k_cache, v_cache, req_to_token, seq_lens = make_case(64, 2, 1, 16, 300, torch.float32, torch.int64, seed=5)
    req_to_token[req_to_token == PAD_SLOT] = 0
    seq_lens[:-1] = (seq_lens[:-1] - 1) % 64 + 1
    outs = []
    for batch in FIXED_SPLIT_BATCHES:
        rows = slice(64 - batch, 64)
        width = int(seq_lens[rows].max())
        for table in (req_to_token[rows, :width], torch.nn.functional.pad(req_to_token[rows], (0, 40))):
            out = decode_attention(q[rows], k_cache, v_cache, table.contiguous(), seq_lens[rows], 0.3, keys_per_split=64,
                                   block=16)
            outs.append((batch, out[-1]))
    expected = decode_attention_reference(q[-1:], k_cache, v_cache, req_to_token[-1:], seq_lens[-1:], 0.3)[0]
    return {"error": max((o - expected).abs().max().item() for _, o in outs),
            "equal": {batch: torch.equal(o, outs[0][1]) for batch, o in outs}}


@pytest.mark.timeout(600)
def test_fixed_keys_per_split_gives_a_row_the_same_bits_at_any_batch():
    result = run_under_triton_interpreter(_interpreted_fixed_splits)
    assert result["error"] < 1e-5
    assert result["equal"] == {batch: True for batch in FIXED_SPLIT_BATCHES}


@pytest.mark.parametrize("batch,kv_heads,context,expected", [
    (1, 4, 8192, (64, 64)),  # 132 wanted for 4 programs per SM on 132 SMs, capped at MAX_SPLITS
    (1, 4, 128, (1, 128)),  # a short span: one split of one block, whatever the batch
    (1, 4, 40, (1, 64)),  # the block: the span rounded up to a power of two
    (128, 4, 100, (1, 128)),
    (1, 4, 192, (3, 64)),  # at most one split per 64-key block of the width
    (8, 4, 2048, (16, 64)),
    (15, 4, 8192, (8, 64)),  # 60 (sequence, kv head) rows: still a small batch
    (16, 4, 8192, (4, 128)),  # mid-size: 128-key blocks, floor(264 / 64) splits
    (32, 4, 8192, (2, 128)),
    (32, 4, 200, (2, 128)),  # two 128-key blocks of width
    (66, 4, 8192, (1, 128)),  # 264 rows: the last mid-size batch
    (67, 4, 8192, (1, 64)),
    (128, 4, 8192, (1, 64)),
    (256, 4, 8192, (1, 64)),  # already more programs than wanted
])
def test_choose_launch_from_shapes(batch, kv_heads, context, expected):
    assert choose_launch(batch, kv_heads, context, num_sms=132) == expected


@pytest.mark.parametrize("batch, context, window, splits", [
    (1, 131072, 0, 64),  # gpt-oss's full-attention layers at a long context: MAX_SPLITS
    (1, 131072, 128, 1),  # its sliding layers: the keys a row can hold are the window's 128, one block
    (1, 100, 128, 1),  # a window wider than the context: the context's 100 keys, one block
    (1, 131072, 256, 4),  # a wider window: one split per 64-key block of it
    (1, 131072, 4096, 64),
    (32, 131072, 128, 1),  # 256 rows: a mid-size batch's 128-key blocks, one of them holds the window
])
def test_the_split_count_follows_the_window_where_it_is_narrower(batch, context, window, splits):
    q = torch.empty(batch, 64, 64)
    assert plan_splits(q, 8, context, None, None, None, window).splits == splits


def test_bad_inputs_raise_clear_errors():
    q, k_cache, v_cache, req_to_token, seq_lens = make_case(2, 2, 2, 64, 40, torch.float32, torch.int64, seed=3)
    bad = {
        "power of two": (q[..., :48], k_cache[..., :48], v_cache[..., :48], req_to_token, seq_lens),
        "multiple of num_kv_heads": (q[:, :3], k_cache, v_cache, req_to_token, seq_lens),
        "share one dtype": (q, k_cache.half(), v_cache, req_to_token, seq_lens),
        "int32 or int64": (q, k_cache, v_cache, req_to_token.float(), seq_lens),
        "req_to_token [B, C]": (q, k_cache, v_cache, req_to_token[:1], seq_lens),
        "contiguous": (q, k_cache.transpose(1, 2).contiguous().transpose(1, 2), v_cache, req_to_token, seq_lens),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            decode_attention(*args, scale=0.125)
    with pytest.raises(ValueError, match="keys_per_split must be a positive multiple of the block"):
        decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, 0.125, keys_per_split=100)
    for block in (8, 96):
        with pytest.raises(ValueError, match="block must be a power of two >= 16"):
            decode_attention(q, k_cache, v_cache, req_to_token, seq_lens, 0.125, num_splits=1, block=block)
    table, row_ids = spread_rows(req_to_token, spare=2, seed=3)
    bad_rows = {
        "row_ids [B]": row_ids[:1],
        "row_ids must be int32 or int64": row_ids.float(),
        "row_ids must be contiguous": torch.stack([row_ids, row_ids], 1)[:, 0],
    }
    for message, rows in bad_rows.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125, row_ids=rows)
