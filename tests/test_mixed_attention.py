"""Attention of a mixed step in batch-invariant mode (layers/attention.py): an extend batch whose
first sequences are decodes riding along with prompt chunks. Its decode rows must have the bits
of a pure decode batch and its prompt rows those of a pure extend batch, on the torch path (CPU)
and with the Triton kernels (under Triton's CPU interpreter, in a spawned process), with the
sequences' table rows gathered or read through row ids (a runner's whole request table). The
Triton extend kernel gives a decode row other bits than the decode kernel: that is why the mixed
step is split (a check that fails, and says the split could go, if the kernels ever agree).
"""
from __future__ import annotations

import pytest
import torch

from arfusion.layers import batch_invariant as bi
from arfusion.layers.attention import Attention, BatchPart, split_decodes
from tests.dist_utils import run_under_triton_interpreter

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32
DECODE_LENS = (70, 300, 5)  # the decodes' lengths (300: two splits of the decode kernel's 256 keys)
PROMPTS = ((40, 25), (0, 33))  # (cached prefix, new tokens) of the prompt chunks
ROWS = 9  # request table rows (the batch's 5 at random ones)


def _case(seed: int) -> dict:
    """A mixed batch (as gathered rows and as row ids into a table), its decode part and its
    extend part as batches of their own, q and the caches; random, seeded."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [*DECODE_LENS, *(p + n for p, n in PROMPTS)]
    extend_lens = [1] * len(DECODE_LENS) + [n for _, n in PROMPTS]
    width = max(seq_lens)
    slots = torch.randperm(len(seq_lens) * width + 1, generator=g)[:len(seq_lens) * width].view(len(seq_lens), width)
    row_ids = torch.randperm(ROWS, generator=g)[:len(seq_lens)]
    table = torch.zeros(ROWS, width, dtype=torch.int64)
    table[row_ids] = slots
    num_slots = int(slots.max()) + 1
    d = len(DECODE_LENS)
    lens, news = torch.tensor(seq_lens), torch.tensor(extend_lens)
    tokens = sum(extend_lens)
    mapping = torch.arange(tokens)  # unread by attend

    def batch(decode: bool, rows: slice, by_row_id: bool, num_decodes: int = 0) -> BatchPart:
        return BatchPart(decode, lens[rows], news[rows], mapping, table if by_row_id else slots[rows],
                         row_ids[rows] if by_row_id else None, int(news[rows].max()), num_decodes)

    return {
        "q": torch.randn(tokens, HEADS * HEAD_DIM, generator=g) * 2,
        "k": torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g),
        "v": torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=g),
        "d": d,
        "batches": {by_row_id: (batch(False, slice(None), by_row_id, d), batch(True, slice(0, d), by_row_id),
                                batch(False, slice(d, None), by_row_id)) for by_row_id in (False, True)},
    }


def _compare(seed: int) -> dict:
    """Per (gathered or row ids): whether the mixed batch's decode rows and prompt rows equal those
    of the pure batches, bit for bit, and whether the extend path alone gives the decode rows
    the pure decode batch's bits (batch-invariant mode)."""
    case = _case(seed)
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
    q, k, v, d = case["q"], case["k"], case["v"], case["d"]
    out = {}
    with bi.batch_invariant_mode(True):
        for by_row_id, (mixed, decodes, prompts) in case["batches"].items():
            together = layer.attend(q, k, v, mixed)
            alone_decodes = layer.attend(q[:d], k, v, decodes)
            one_call = layer._extend(q.view(-1, HEADS, HEAD_DIM), k, v, mixed).view(q.shape)
            out[by_row_id] = {"decodes": torch.equal(together[:d], alone_decodes),
                              "prompts": torch.equal(together[d:], layer.attend(q[d:], k, v, prompts)),
                              "extend path = decode path": torch.equal(one_call[:d], alone_decodes)}
    return out


def _compare_with_triton_kernels(rank: int, world_size: int) -> dict:
    """`_compare` with `Attention` taking its Triton path on CPU tensors (under the interpreter)."""
    Attention.uses_triton = lambda self, q: True  # fp32, head dim 32: the kernels take it
    return _compare(seed=1)


@pytest.mark.parametrize("by_row_id", [False, True])
def test_torch_path_mixed_rows_have_the_bits_of_their_own_kind(by_row_id: bool):
    result = _compare(seed=0)[by_row_id]
    assert result["decodes"] and result["prompts"], result
    assert result["extend path = decode path"], "on the torch path a prompt row and a decode row agree"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("by_row_id", [False, True])
def test_triton_kernels_mixed_rows_have_the_bits_of_their_own_kind(by_row_id: bool):
    pytest.importorskip("triton")
    result = interpreted()[by_row_id]
    assert result["decodes"] and result["prompts"], result
    assert not result["extend path = decode path"], "the extend kernel now gives decode rows the decode kernel's bits"


_INTERPRETED: dict = {}


def interpreted() -> dict:
    """`_compare_with_triton_kernels` in a spawned interpreter process, once per session."""
    if not _INTERPRETED:
        _INTERPRETED.update(run_under_triton_interpreter(_compare_with_triton_kernels, timeout_s=240))
    return _INTERPRETED


def test_split_decodes_refuses_a_batch_without_decodes_or_prompts():
    mixed = _case(seed=2)["batches"][False][0]
    for d in (0, len(DECODE_LENS) + len(PROMPTS)):
        with pytest.raises(ValueError, match="need 0 < num_decodes < 5 sequences"):
            split_decodes(BatchPart(**{**mixed.__dict__, "num_decodes": d}))
