"""Attention's torch paths in bounded pieces (`layers.attention.MAX_SCORES`): the same outputs
whatever the piece size, no piece's intermediate above the bound (counted on every call of
scaled_dot_product_attention), and a long prompt's peak memory bounded (VmHWM of a child process)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from arfusion.engine.models.forward_batch import ForwardBatch
from arfusion.layers import attention as attention_module
from arfusion.layers.attention import MAX_SCORES, Attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
FP32 = {"rtol": 1e-5, "atol": 1e-5}  # the pieces sum the same products in another blocking


def _case(seed: int, new_tokens: list[list[int]], seq_lens: list[int], max_context=None):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(seq_lens) + 1
    k_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g)
    slots = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()
    seq_slots, start = [], 0
    for n in seq_lens:
        seq_slots.append(slots[start:start + n])
        start += n
    batch = ForwardBatch.from_lists(new_tokens, seq_slots, max_context=max_context)
    q = torch.randn(batch.num_tokens, HEADS * HEAD_DIM, generator=g)
    return q, k_cache, v_cache, batch


class ScoreSizes:
    """Records the scores' size (query heads x queries x keys) of every attention call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        real = F.scaled_dot_product_attention

        def recording(q, k, v, **kwargs):
            self.sizes.append(q.shape[-3] * q.shape[-2] * k.shape[-2] * (q.shape[0] if q.dim() == 4 else 1))
            return real(q, k, v, **kwargs)

        monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recording)


# (new tokens per sequence, sequence lengths): a fresh prompt, a chunk after a cached prefix
# mixed with decodes (a mixed step), a one-token prompt
EXTEND_CASES = [([[0] * 150], [150]), ([[0], [0] * 70, [0]], [33, 120, 9]), ([[0]], [1])]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("new_tokens,seq_lens", EXTEND_CASES)
@pytest.mark.parametrize("max_scores", [1, 700, 5000])
def test_extend_in_pieces_equals_the_whole_and_no_piece_exceeds_the_bound(monkeypatch, seed, new_tokens, seq_lens,
                                                                          max_scores):
    q, k_cache, v_cache, batch = _case(seed, new_tokens, seq_lens)
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    attn.max_scores = 10 ** 9
    whole = attn.attend(q, k_cache, v_cache, batch)
    sizes = ScoreSizes(monkeypatch)
    attn.max_scores = max_scores
    torch.testing.assert_close(attn.attend(q, k_cache, v_cache, batch), whole, **FP32)
    longest = max(seq_lens)
    assert max(sizes.sizes) <= max(max_scores, HEADS * longest), "one query's scores at least"
    assert len(sizes.sizes) >= sum(n * HEADS * s // max(max_scores, HEADS * s) for n, s in
                                   zip(map(len, new_tokens), seq_lens)), "the pieces cover every query"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_scores", [1, 3000, 10 ** 9])
def test_decode_in_pieces_equals_the_whole_and_no_piece_exceeds_the_bound(monkeypatch, seed, max_scores):
    q, k_cache, v_cache, batch = _case(seed, [[0]] * 5, [7, 40, 1, 64, 13], max_context=64)
    assert batch.is_decode
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    attn.max_scores = 10 ** 9
    whole = attn.attend(q, k_cache, v_cache, batch)
    sizes = ScoreSizes(monkeypatch)
    attn.max_scores = max_scores
    torch.testing.assert_close(attn.attend(q, k_cache, v_cache, batch), whole, **FP32)
    rows = max(1, max_scores // (HEADS * 64 * HEAD_DIM))
    assert len(sizes.sizes) == -(-5 // rows), "rows at a time, each row's keys expanded within the bound"


_CHILD = """
import torch
from arfusion.engine.models.forward_batch import ForwardBatch
from arfusion.layers.attention import Attention

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

tokens, heads, kv_heads, d = {tokens}, 8, 4, 64
g = torch.Generator().manual_seed(0)
k_cache, v_cache = torch.randn(tokens + 1, kv_heads, d, generator=g), torch.randn(tokens + 1, kv_heads, d, generator=g)
batch = ForwardBatch.from_lists([[0] * tokens], [list(range(1, tokens + 1))])
q = torch.randn(tokens, heads * d, generator=g)
out = torch.empty_like(q)
attn = Attention(heads, kv_heads, d, d ** -0.5)
before = status("VmRSS")
out = attn.attend(q, k_cache, v_cache, batch)
print(status("VmHWM") - before)
"""


def test_a_long_prompts_attention_takes_memory_of_the_bound_not_of_its_length_squared():
    """A 4096-token prompt over 8 query heads: its whole scores would take 8 * 4096^2 fp32 (512
    MiB, twice that with the softmax); the pieces' peak stays within a few pieces' scores (the
    scores, their softmax, the mask and the expanded keys and values of one piece)."""
    tokens = 4096
    child = subprocess.run([sys.executable, "-c", _CHILD.format(tokens=tokens)], capture_output=True, text=True,
                           timeout=300, check=True)
    peak = int(child.stdout.strip())
    whole_scores = 8 * tokens * tokens * 4
    assert peak <= 6 * MAX_SCORES * 4 < whole_scores, f"peak {peak / 2**20:.0f} MiB"


_DETERMINISTIC_CHILD = """
import torch
from arfusion.engine.models.forward_batch import ForwardBatch
from arfusion.layers.attention import Attention
from arfusion.layers.batch_invariant import batch_invariant_mode

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

rows, context, heads, kv_heads, d = {rows}, {context}, 8, 4, 64
g = torch.Generator().manual_seed(0)
slots = rows * context + 1
k_cache, v_cache = torch.randn(slots, kv_heads, d, generator=g), torch.randn(slots, kv_heads, d, generator=g)
if rows == 1:  # a whole prompt
    batch = ForwardBatch.from_lists([[0] * context], [list(range(1, context + 1))])
else:  # a decode batch: one long sequence, the others of 33 tokens
    lens = [context] + [33] * (rows - 1)
    seq_slots = [list(range(1 + i * context, 1 + i * context + n)) for i, n in enumerate(lens)]
    batch = ForwardBatch.from_lists([[0]] * rows, seq_slots)
q = torch.randn(batch.num_tokens, heads * d, generator=g)
attn = Attention(heads, kv_heads, d, d ** -0.5)
before = status("VmRSS")
with batch_invariant_mode(True):
    out = attn.attend(q, k_cache, v_cache, batch)
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("rows, context", [(1, 4096), (64, 4096)])
def test_deterministic_attention_takes_memory_of_the_bound(rows, context):
    """Batch-invariant mode's torch path (layers/batch_invariant_attention.py) in a child process:
    a 4096-token prompt, and a decode batch of 64 rows beside one of 4096 tokens (padding every
    row to the longest in fp32 and expanding the keys to every query head would take 64 * 4096
    * 8 * 64 * 4 bytes = 512 MiB for the keys alone): the peak stays within a few pieces'
    scores (the scores and their weights, the gathered keys and values of one piece)."""
    child = subprocess.run([sys.executable, "-c", _DETERMINISTIC_CHILD.format(rows=rows, context=context)],
                           capture_output=True, text=True, timeout=300, check=True)
    peak = int(child.stdout.strip())
    assert peak <= 6 * MAX_SCORES * 4, f"peak {peak / 2**20:.0f} MiB"


def test_deterministic_prefill_reads_the_causal_keys_only(monkeypatch):
    """A prompt's query groups each read the key blocks up to their last query: the products
    formed sum to about T^2 / 2 (plus a block and a group per group), not T^2."""
    from arfusion.layers import batch_invariant_attention as bia
    from arfusion.layers.batch_invariant import batch_invariant_mode

    calls: list[tuple[int, int]] = []
    real = bia._attend_blocks

    def recording(q, q_pos, keys, values, scale):
        calls.append((q.shape[1], keys.shape[1]))
        return real(q, q_pos, keys, values, scale)

    monkeypatch.setattr(bia, "_attend_blocks", recording)
    tokens = 800
    q, k_cache, v_cache, batch = _case(0, [[0] * tokens], [tokens])
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    attn.max_scores = 1 << 16
    with batch_invariant_mode(True):
        attn.attend(q, k_cache, v_cache, batch)
    queries = max(t for t, _ in calls)
    assert sum(t for t, _ in calls) == tokens and len(calls) == -(-tokens // queries)
    assert sum(t * n for t, n in calls) <= tokens * (tokens + queries) / 2
