"""The Triton extend (prefill) attention kernel under Triton's CPU interpreter, against the fp32
torch reference (per sequence, bottom-right-aligned causal mask), and the reference against the
layer's torch extend path.

Skipped when triton is not installed. As in tests/test_triton_decode_attention.py, the kernel
cases run in one spawned process with TRITON_INTERPRET=1 (the interpreter is chosen when triton
is imported) and each parametrized test checks its own case's result; host-side checks run here.

Tolerances (tests/tolerances.py): fp32 1e-5, fp16 1e-2 (rtol and atol) against the fp32
reference. bf16 is checked on the GPU only (tests/gpu/test_triton_extend_attention.py): the
interpreter's ``tl.dot`` multiplies bf16 bit patterns (triton-lang/triton#11584); here only the
reference is compared with the layer's torch path in bf16.
"""
import re
from types import SimpleNamespace
from typing import NamedTuple, Optional

import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.attention import Attention  # noqa: E402
from arfusion.layers.kernels.triton_extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from tests.attention_cases import PAD_SLOT, result_checker, spread_rows  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402



class Case(NamedTuple):
    name: str
    prefix_lens: list[int]  # cached tokens per sequence
    extend_lens: list[int]  # new tokens per sequence
    group: int  # query heads per kv head
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    index_dtype: torch.dtype = torch.int64
    block_m: Optional[int] = None  # None: choose_block_config
    block_n: Optional[int] = None
    strided_q: bool = False  # q as a [T, H*D] view of a packed qkv projection


CASES = [
    Case("prefill-g1-d64-fp32", [0, 0], [37, 70], 1, 2, 64, torch.float32),
    Case("prefix-g1-d64-fp32", [0, 50, 130, 64], [37, 20, 1, 64], 1, 2, 64, torch.float32),
    Case("prefix-g4-d128-fp16", [0, 33, 100], [70, 45, 1], 4, 2, 128, torch.float16),
    Case("prefix-g4-d128-fp32-blocks16", [0, 33, 100, 17], [70, 45, 1, 16], 4, 1, 128, torch.float32,
         torch.int32, block_m=16, block_n=16),
    Case("prefix-g1-d128-fp16-blocks32x16", [15, 0, 200], [2, 40, 33], 1, 4, 128, torch.float16,
         block_m=32, block_n=16),
    Case("prefix-g4-d64-fp16-strided-q", [7, 0], [30, 19], 4, 2, 64, torch.float16, torch.int32, strided_q=True),
    Case("g3-padded-heads-fp32", [0, 5], [20, 9], 3, 2, 64, torch.float32, block_m=16, block_n=16),
    Case("g32-two-head-chunks-fp32", [0, 5], [20, 9], 32, 1, 16, torch.float32, block_m=16, block_n=16),
    Case("no-new-tokens-fp32", [3, 0, 10], [0, 9, 4], 2, 2, 64, torch.float32, block_m=16, block_n=16),
]

ROW_ID_CASES = [
    Case("rows-g4-d64-fp16", [0, 40, 9], [33, 1, 20], 4, 2, 64, torch.float16),
    Case("rows-g1-d128-fp32", [70, 0], [5, 30], 1, 2, 128, torch.float32, torch.int32, block_m=16, block_n=32),
]


def make_case(case: Case, seed: int):
    """``(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens)``: random q and caches, each
    sequence's slots a random part of one permutation of the cache (scattered, disjoint), rows
    padded with PAD_SLOT past seq_len; q ``[T, H*D]``."""
    g = torch.Generator().manual_seed(seed)
    heads = case.group * case.kv_heads
    seq_lens = [p + e for p, e in zip(case.prefix_lens, case.extend_lens)]
    tokens, context = sum(case.extend_lens), max(seq_lens)
    num_slots = sum(seq_lens) + 11
    if case.strided_q:
        qkv = torch.randn(tokens, (heads + 2 * case.kv_heads) * case.head_dim, generator=g).to(case.dtype)
        q = qkv[:, :heads * case.head_dim]
    else:
        q = torch.randn(tokens, heads * case.head_dim, generator=g).to(case.dtype)
    k_cache = torch.randn(num_slots, case.kv_heads, case.head_dim, generator=g).to(case.dtype)
    v_cache = torch.randn(num_slots, case.kv_heads, case.head_dim, generator=g).to(case.dtype)
    perm = torch.randperm(num_slots, generator=g)
    req_to_token = torch.full((len(seq_lens), context), PAD_SLOT, dtype=torch.int64)
    first = 0
    for i, n in enumerate(seq_lens):
        req_to_token[i, :n] = perm[first:first + n]
        first += n
    index = case.index_dtype
    return (q, k_cache, v_cache, req_to_token.to(index), torch.tensor(seq_lens, dtype=index),
            torch.tensor(case.extend_lens, dtype=index))


def _interpreted_cases(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: every case. Returns per key None when the check passed,
    else the assertion message."""
    import triton

    assert triton.knobs.runtime.interpret, "the child must run the interpreter"
    results = {}
    check = result_checker(results)

    for seed, case in enumerate(CASES):
        q, k_cache, v_cache, req_to_token, seq_lens, extend_lens = make_case(case, seed)
        scale = case.head_dim ** -0.5
        blocks = {"block_m": case.block_m, "block_n": case.block_n}
        out = extend_attention(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, scale, **blocks)
        heads = case.group * case.kv_heads
        assert out.shape == (q.shape[0], heads, case.head_dim) and out.dtype == case.dtype, (out.shape, out.dtype)
        expected = extend_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, scale)
        check(case.name, out.float(), expected, *TOLERANCES[case.dtype])
        # the same call with q [T, H, D] and with the grid sized from a host bound (tight, and T): same bits
        q3 = q.unflatten(1, (heads, case.head_dim))
        check((case.name, "q [T, H, D]"), extend_attention(q3, k_cache, v_cache, req_to_token, seq_lens,
                                                           extend_lens, scale, **blocks), out, 0, 0)
        for bound in (max(case.extend_lens), q.shape[0]):
            again = extend_attention(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, scale,
                                     max_extend_len=bound, **blocks)
            check((case.name, "max_extend_len", bound == q.shape[0]), again, out, 0, 0)
        masked = extend_attention(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, scale, mask_all=True,
                                  **blocks)
        check((case.name, "mask_all"), masked.float(), expected, *TOLERANCES[case.dtype])

    for seed, case in enumerate(ROW_ID_CASES, start=len(CASES)):
        q, k_cache, v_cache, req_to_token, seq_lens, extend_lens = make_case(case, seed)
        table, row_ids = spread_rows(req_to_token, spare=3, seed=seed)
        blocks = {"block_m": case.block_m, "block_n": case.block_n}
        out = extend_attention(q, k_cache, v_cache, table, seq_lens, extend_lens, 0.3, row_ids=row_ids, **blocks)
        expected = extend_attention_reference(q, k_cache, v_cache, table, seq_lens, extend_lens, 0.3, row_ids=row_ids)
        check((case.name, "row_ids"), out.float(), expected, *TOLERANCES[case.dtype])
        gathered = extend_attention(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, 0.3, **blocks)
        check((case.name, "row_ids = gathered rows"), out, gathered, 0, 0)
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted_cases)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_fp32_reference(interpreted, case):
    """Against the reference (also with every key block masked, as in batch-invariant mode); q
    ``[T, H, D]`` and a grid sized from ``max_extend_len`` (tight or T) give the same bits as q
    ``[T, H*D]`` with the bound read from the device."""
    keys = [case.name, (case.name, "q [T, H, D]"), (case.name, "max_extend_len", False),
            (case.name, "max_extend_len", True), (case.name, "mask_all")]
    for key in keys:
        assert interpreted[key] is None, f"{key}: {interpreted[key]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ROW_ID_CASES, ids=lambda c: c.name)
def test_row_ids_read_rows_of_a_larger_table(interpreted, case):
    """Sequence i reads ``req_to_token[row_ids[i]]``: as the reference, and bit for bit as the
    call with those rows gathered."""
    for key in ((case.name, "row_ids"), (case.name, "row_ids = gathered rows")):
        assert interpreted[key] is None, f"{key}: {interpreted[key]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: c.name)
def test_reference_matches_the_layer_torch_path(case, dtype):
    """The reference (fp32 einsum) and ``Attention.attend`` in extend mode (per-sequence
    scaled_dot_product_attention in the input dtype) agree within the dtype's tolerance."""
    q, k_cache, v_cache, req_to_token, seq_lens, extend_lens = make_case(case._replace(dtype=dtype), seed=5)
    req_to_token[req_to_token == PAD_SLOT] = 0  # the layer gathers whole rows
    heads, scale = case.group * case.kv_heads, case.head_dim ** -0.5
    batch = SimpleNamespace(is_decode=False, seq_lens=seq_lens, extend_lens=extend_lens, req_to_token=req_to_token,
                            row_ids=None)
    layer = Attention(heads, case.kv_heads, case.head_dim, scale).attend(q, k_cache, v_cache, batch)
    expected = extend_attention_reference(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, scale)
    assert layer.dtype == dtype
    torch.testing.assert_close(layer.float().unflatten(1, (heads, case.head_dim)), expected, rtol=TOLERANCES[dtype][0],
                               atol=TOLERANCES[dtype][1])


def test_bad_inputs_raise_clear_errors():
    case = Case("bad", [4, 0], [3, 5], 2, 2, 64, torch.float32)
    q, k_cache, v_cache, req_to_token, seq_lens, extend_lens = make_case(case, seed=3)
    table, row_ids = spread_rows(req_to_token, spare=2, seed=3)
    bad = {
        "q [T, H*D] or [T, H, D]": dict(q=q.flatten()),
        "power of two": dict(q=q[:, :4 * 48], k_cache=k_cache[..., :48], v_cache=v_cache[..., :48]),
        "multiple of num_kv_heads": dict(q=q[:, :3 * 64]),
        "share one dtype": dict(k_cache=k_cache.half()),
        "seq_lens must be int32 or int64": dict(seq_lens=seq_lens.float()),
        "req_to_token [B, C] with B=2": dict(req_to_token=req_to_token[:1]),
        "extend_lens [B]": dict(extend_lens=extend_lens[:1]),
        "row_ids [B]": dict(req_to_token=table, row_ids=row_ids[:1]),
        "row_ids must be int32 or int64": dict(req_to_token=table, row_ids=row_ids.float()),
        "must be contiguous": dict(k_cache=k_cache.transpose(1, 2).contiguous().transpose(1, 2)),
        "seq_lens, extend_lens and row_ids must be contiguous": dict(seq_lens=torch.stack([seq_lens] * 2, 1)[:, 0]),
        "need 0 <= extend_lens <= seq_lens": dict(extend_lens=torch.tensor([3, 6])),
        "exceed the width": dict(seq_lens=seq_lens + 1, extend_lens=extend_lens),
        "q has 7 tokens but sum(extend_lens) = 8": dict(q=q[:7]),
        "max_extend_len must be in [0, T=8]": dict(max_extend_len=9),
        "block_m and block_n must be powers of two >= 16": dict(block_m=24),
    }
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, seq_lens=seq_lens,
                extend_lens=extend_lens, scale=0.125)
    for message, changed in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            extend_attention(**(args | changed))


def test_no_new_tokens_returns_an_empty_output_without_a_launch():
    case = Case("empty", [4, 2], [0, 0], 2, 2, 64, torch.float32)
    q, k_cache, v_cache, req_to_token, seq_lens, extend_lens = make_case(case, seed=4)
    out = extend_attention(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, 0.125)
    assert out.shape == (0, 4, 64) and out.dtype == torch.float32
