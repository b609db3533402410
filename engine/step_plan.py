"""`StepPlan`: what TP rank 0 broadcasts before each forward step, and how every rank turns it
into a `ForwardBatch`.

Every rank keeps the same request-to-token table on its device (``[rows + 1, context]``, the
last row is the padding row); a plan carries only what changed: for each sequence its table
row, its new tokens, the slots of those new tokens and its total length. That keeps the
broadcast small (O(new tokens)), whatever the context lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.forward_batch import ForwardBatch, ForwardMode


@dataclass
class StepPlan:
    kind: str  # "extend" | "decode" | "shutdown"
    rows: list[int] = field(default_factory=list)
    new_tokens: list[list[int]] = field(default_factory=list)
    new_slots: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.rows)


class RequestTable:
    """The device-side request-to-token table of one rank."""

    def __init__(self, num_rows: int, context_len: int, device: torch.device) -> None:
        self.context_len = context_len
        self.pad_row = num_rows
        self.table = torch.zeros(num_rows + 1, context_len, dtype=torch.int64, device=device)
        self.device = device

    def apply(self, plan: StepPlan, width: int | None = None) -> ForwardBatch:
        """Record the plan's new slots in the table (in place) and build its batch.
        ``width``: columns of ``req_to_token`` (default: the longest sequence). All the plan's
        integers travel to the device in one copy."""
        rows, cols, slots = [], [], []
        for row, new, seq_len in zip(plan.rows, plan.new_slots, plan.seq_lens):
            if seq_len > self.context_len:
                raise ValueError(f"sequence of {seq_len} tokens exceeds the context length {self.context_len}")
            rows.extend([row] * len(new))
            cols.extend(range(seq_len - len(new), seq_len))
            slots.extend(new)
        input_ids = [t for toks in plan.new_tokens for t in toks]
        extend_lens = [len(t) for t in plan.new_tokens]
        fields = (input_ids, cols, slots, rows, plan.seq_lens, extend_lens, plan.rows)
        host = torch.tensor([v for f in fields for v in f], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        packed = torch.split(host.to(self.device, non_blocking=True), [len(f) for f in fields])
        input_ids_t, positions, slot_mapping, rows_t, seq_lens, extend_lens_t, plan_rows = packed
        self.table[rows_t, positions] = slot_mapping
        width = width or max(plan.seq_lens)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if plan.kind == "decode" else ForwardMode.EXTEND,
            input_ids=input_ids_t,
            positions=positions,
            seq_lens=seq_lens,
            extend_lens=extend_lens_t,
            slot_mapping=slot_mapping,
            req_to_token=self.table[plan_rows, :width],
        )
