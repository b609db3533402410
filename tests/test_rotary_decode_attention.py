"""The decode attention that rotates its own query and writes the new key
(layers/kernels/triton_rotary_decode_attention.py) under Triton's CPU interpreter, against the two
launches it replaces: `rotary_embedding_store_kv`, then `decode_attention`.

Under the interpreter neither launch contracts multiplies and adds, so the fused launch must give
the same bits as the pair: the whole K and V caches after the call (the new keys and values in
their slots, nothing else touched) and the attention output; the output also within the fp32
reference's tolerance. Cases cover Qwen3's per-head norm, a 1-row group, sinks with a window
(gpt-oss), row ids, one split and many, fp16 and fp32 (bf16: the GPU test,
tests/gpu/test_rotary_decode_attention_gpu.py, as the interpreter's bf16 dots are not bf16 math).
"""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.head_norm import HeadNorm  # noqa: E402
from arfusion.layers.kernels.triton_rotary_decode_attention import decode_attention_rotary  # noqa: E402
from arfusion.layers.rotary_embedding import rope_inv_freq  # noqa: E402
from tests.attention_cases import PAD_SLOT, result_checker, spread_rows  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

# (batch, group, kv_heads, head_dim, context, dtype, num_splits, head_norm, sinks_and_window, row_ids)
CASES = [
    (1, 4, 4, 128, 200, torch.float16, None, True, False, False),  # qwen3-like at batch 1: many splits
    (3, 2, 2, 64, 300, torch.float32, 5, True, False, True),
    (4, 1, 2, 64, 150, torch.float16, 1, False, False, False),  # one split: out written directly
    (2, 8, 1, 64, 90, torch.float32, 3, False, True, False),  # gpt-oss-like: sinks, a window of 40
    (5, 4, 2, 128, 260, torch.float16, None, False, True, True),
]
WINDOW = 40


def _case(batch, group, kv_heads, dim, context, dtype, seed):
    """Raw q/k/v rows of a packed projection, caches, ragged seq_lens (the last row at the
    width, the first at 1), rows of random slots padded with PAD_SLOT, no slot in two rows (as
    the KV pool hands them out: a row's new key is no other row's key); the new token
    of row b at position seq_lens[b] - 1 in slot req_to_token[b, seq_lens[b] - 1]."""
    g = torch.Generator().manual_seed(seed)
    heads = group * kv_heads
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    slots = batch * context + 5
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    seq_lens = torch.randint(1, context + 1, (batch,), generator=g)
    seq_lens[-1] = context
    seq_lens[0] = 1 if batch > 1 else seq_lens[0]
    table = torch.full((batch, context), PAD_SLOT, dtype=torch.int64)
    free = torch.randperm(slots, generator=g)
    for b in range(batch):
        table[b, :seq_lens[b]] = free[b * context:b * context + seq_lens[b]]
    slot_mapping = table[torch.arange(batch), seq_lens - 1].clone()
    head_norm = HeadNorm((1 + 0.3 * torch.randn(dim, generator=g)).to(dtype),
                         (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype), 1e-6)
    sinks = torch.randn(heads, generator=g)
    return q, k, v, k_cache, v_cache, table, seq_lens, slot_mapping, head_norm, sinks


def _interpreted(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: every case, fused against the two launches."""
    from arfusion.layers.kernels.triton_decode_attention import decode_attention, decode_attention_reference
    from arfusion.layers.kernels.triton_rotary import rotary_embedding_store_kv

    results: dict = {}
    check = result_checker(results)
    for case in CASES:
        batch, group, kv_heads, dim, context, dtype, splits, with_norm, with_sinks, with_rows = case
        q, k, v, k_cache, v_cache, table, seq_lens, slot_mapping, head_norm, sinks = _case(
            batch, group, kv_heads, dim, context, dtype, seed=batch * 10 + group)
        row_ids = None
        if with_rows:
            table, row_ids = spread_rows(table, spare=2, seed=batch)
        positions = seq_lens - 1
        inv_freq = rope_inv_freq(dim, 10000.0)
        extra = dict(sinks=sinks, window=WINDOW) if with_sinks else {}
        norm = head_norm if with_norm else None
        k_pair, v_pair = k_cache.clone(), v_cache.clone()
        rotated = rotary_embedding_store_kv(positions, q, k, v, inv_freq, slot_mapping, k_pair, v_pair, head_norm=norm)
        expected = decode_attention(rotated.view(batch, -1, dim), k_pair, v_pair, table, seq_lens, 0.3,
                                    num_splits=splits, row_ids=row_ids, **extra)
        out = decode_attention_rotary(positions, q, k, v, inv_freq, slot_mapping, k_cache, v_cache, table, seq_lens,
                                      0.3, head_norm=norm, row_ids=row_ids, num_splits=splits, **extra)
        check((case, "k_cache"), k_cache, k_pair, 0, 0)
        check((case, "v_cache"), v_cache, v_pair, 0, 0)
        check((case, "out"), out, expected, 0, 0)
        if not with_sinks:
            reference = decode_attention_reference(rotated.view(batch, -1, dim), k_pair, v_pair, table, seq_lens, 0.3,
                                                   row_ids=row_ids)
            check((case, "reference"), out.float(), reference, *TOLERANCES[dtype])
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_same_bits_as_rotary_then_attention(interpreted, case):
    for part in ("k_cache", "v_cache", "out", "reference"):
        if (case, part) in interpreted:
            assert interpreted[(case, part)] is None, (part, interpreted[(case, part)])


def test_bad_operands_are_refused():
    """The two launches' own checks, before anything runs."""
    q, k, v, k_cache, v_cache, table, seq_lens, slot_mapping, head_norm, _ = _case(2, 2, 2, 64, 30, torch.float16, 1)
    inv_freq = rope_inv_freq(64, 10000.0)
    args = (seq_lens - 1, q, k, v, inv_freq, slot_mapping, k_cache, v_cache, table, seq_lens, 0.3)
    with pytest.raises(ValueError, match="v must match k"):
        decode_attention_rotary(*args[:3], v[:, :64], *args[4:])
    with pytest.raises(ValueError, match="slot_mapping"):
        decode_attention_rotary(*args[:5], slot_mapping[:1], *args[6:])
    with pytest.raises(ValueError, match="head_norm.q_weight"):
        decode_attention_rotary(*args, head_norm=HeadNorm(head_norm.q_weight[:32], head_norm.k_weight, 1e-6))
    with pytest.raises(ValueError, match="k_cache"):
        decode_attention_rotary(*args[:6], k_cache.float(), *args[7:])
    with pytest.raises(ValueError, match="sinks"):
        decode_attention_rotary(*args, sinks=torch.zeros(3))
