"""What one forward pass needs to know about its batch, and the KV cache it reads and writes.

A batch holds B sequences. Sequence i has ``seq_lens[i]`` tokens in total, of which the last
``extend_lens[i]`` are new in this pass (a prefill: the whole prompt, or the part after a
cached prefix, such as a chunk of a long prompt; a decode step: one token; a mixed extend batch
has both, decodes riding along with prefill chunks: its first ``num_decodes`` sequences, one
new token each). The T = sum(extend_lens) new tokens are packed sequence after sequence.

KV cache: token-slot paging. Every layer has one K and one V tensor of shape
``[num_slots, num_kv_heads_local, head_dim]``; any slot can hold any token of any sequence.
``req_to_token[i, j]`` is the slot of token j of sequence i (for j < seq_lens[i]; entries past
the sequence are ignored), ``slot_mapping[t]`` the slot new token t is written to. With
``row_ids``, req_to_token is a table of any number of rows and sequence i's row is
``row_ids[i]`` (a CUDA-graph runner passes its whole request table: no per-step gather).

Decode batches have static shapes ([B] and [B or R, max_context]) and need no host sync, so a
runner can capture them in a CUDA graph for a fixed, padded B and max_context. A padded row
must still describe a valid sequence: ``seq_lens >= 1`` and slots inside the cache (e.g. a
scratch slot reserved for padding), since a row that attends to nothing has no softmax.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: any number of new tokens per sequence
    DECODE = "decode"  # exactly one new token per sequence


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, the new tokens
    positions: torch.Tensor  # [T] int64, their positions in their sequences
    seq_lens: torch.Tensor  # [B] int64, tokens per sequence including the new ones
    extend_lens: torch.Tensor  # [B] int64, new tokens per sequence (all 1 in decode)
    slot_mapping: torch.Tensor  # [T] int64, the KV slot each new token is written to
    req_to_token: torch.Tensor  # [B, max_context] int64, the slots of each sequence's tokens ([R, ...] with row_ids)
    row_ids: Optional[torch.Tensor] = None  # [B] int64, sequence i's row of req_to_token (None: row i)
    max_extend_len: Optional[int] = None  # host int >= max(extend_lens) when known (sizes kernels without a sync)
    num_decodes: int = 0  # EXTEND: the first num_decodes sequences are decodes riding along (one new token each)

    @property
    def is_decode(self) -> bool:
        return self.forward_mode is ForwardMode.DECODE

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def last_token_indices(self) -> torch.Tensor:
        """``[B]``: the index in the packed tokens of each sequence's last new token
        (``cumsum(extend_lens) - 1``; no host sync)."""
        return torch.cumsum(self.extend_lens, dim=0) - 1

    @classmethod
    def from_lists(
        cls,
        new_tokens: Sequence[Sequence[int]],
        token_slots: Sequence[Sequence[int]],
        device: Optional[torch.device] = None,
        max_context: Optional[int] = None,
    ) -> "ForwardBatch":
        """Build a batch from python lists: ``new_tokens[i]`` are sequence i's new token ids,
        ``token_slots[i]`` the KV slots of all its tokens (cached prefix, then the new ones), so
        ``seq_lens[i] = len(token_slots[i])``. ``max_context`` is the width of ``req_to_token``
        (default: the longest sequence; a CUDA-graph runner fixes it). DECODE when every
        sequence has exactly one new token, else EXTEND."""
        if len(new_tokens) != len(token_slots) or not new_tokens:
            raise ValueError(f"need one slot list per sequence and at least one sequence, got "
                             f"{len(new_tokens)} token lists and {len(token_slots)} slot lists")
        seq_lens = [len(s) for s in token_slots]
        extend_lens = [len(t) for t in new_tokens]
        for i, (n, s) in enumerate(zip(extend_lens, seq_lens)):
            if not 1 <= n <= s:
                raise ValueError(f"sequence {i}: {n} new tokens with {s} slots; need 1 <= new <= slots")
        width = max(seq_lens) if max_context is None else max_context
        if width < max(seq_lens):
            raise ValueError(f"max_context {width} is shorter than the longest sequence ({max(seq_lens)})")
        positions = [p for n, s in zip(extend_lens, seq_lens) for p in range(s - n, s)]
        slot_mapping = [slot for n, slots in zip(extend_lens, token_slots) for slot in slots[len(slots) - n:]]
        req_to_token = [list(slots) + [0] * (width - len(slots)) for slots in token_slots]

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND
        return cls(
            forward_mode=mode,
            input_ids=tensor([t for toks in new_tokens for t in toks]),
            positions=tensor(positions),
            seq_lens=tensor(seq_lens),
            extend_lens=tensor(extend_lens),
            slot_mapping=tensor(slot_mapping),
            req_to_token=tensor(req_to_token),
        )


class KVCache:
    """Per layer, a K and a V tensor ``[num_slots, num_kv_heads, head_dim]`` (this rank's KV
    heads). Slots are handed out by the caller; this class only owns the memory."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        if len(k) != len(v) or not k:
            raise ValueError(f"need one K and one V tensor per layer, got {len(k)} and {len(v)}")
        self.k = k
        self.v = v

    @classmethod
    def allocate(cls, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: Optional[torch.device] = None) -> "KVCache":
        """Zero-filled K and V tensors for every layer."""
        if num_slots < 1:
            raise ValueError(f"a KV cache needs at least one slot, got {num_slots}")
        shape = (num_slots, num_kv_heads, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(k, v)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one token slot takes over all layers (K and V): for sizing the cache."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
