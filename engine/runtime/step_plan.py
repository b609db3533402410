"""`StepPlan`: what TP rank 0 broadcasts before each forward step, and how every rank turns it
into a `ForwardBatch`.

Every rank keeps the same request-to-token table on its device (``[rows + 1, context]``, the
last row is the padding row) and each row's last committed token (``last_tokens``, the token a
sampler picked for that sequence, broadcast from rank 0 on the device); a plan carries only
what changed: for each sequence its table row, its new tokens, the slots of those new tokens
and its total length. That keeps the broadcast small (O(new tokens)), whatever the context
lengths. A plan may leave tokens on the device (``tokens_on_device``): the sequences without a
host token list (all of a decode plan's; the leading ones of an extend plan, decodes riding
along with prefill chunks in one mixed batch) each take one new token, their row's last
committed token, so the host can build and launch step n+1 before it has seen step n's tokens
(the overlap schedule). A prefill sequence may ask for the log-probabilities of its prompt tokens
(``prompt_logprobs``, `engine.runtime.logprobs`): every rank then runs the LM head over all its
new tokens and gathers their logits' vocabulary shards, a collective.

`RequestTable.apply` builds a batch of any shape (its own tensors, a gathered req_to_token);
`DecodeBuffers` refills the static buffers a CUDA-graph decode step reads, with one
host-to-device copy and one index_put per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arfusion.engine.models.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class PromptLogprobs:
    """A prefill sequence of a plan whose new tokens' logits score prompt tokens: its new tokens
    after the first, then ``next_token`` (the prompt token after this chunk; -1 when the chunk
    ends the prompt, whose last row then samples instead)."""

    seq: int  # index of the sequence in the plan (one with a host token list)
    top_k: int  # alternatives per scored token
    next_token: int = -1

    def targets(self, new_tokens: list[int]) -> list[int]:
        """The prompt tokens this chunk's rows score, in order (one per row but the sampling one)."""
        return new_tokens[1:] + ([self.next_token] if self.next_token >= 0 else [])


@dataclass
class StepPlan:
    kind: str  # "extend" | "decode" | "shutdown"
    rows: list[int] = field(default_factory=list)
    new_tokens: list[list[int]] = field(default_factory=list)
    new_slots: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    # the first ``num_device_tokens`` sequences have no host token list: each one's one new
    # token is ``last_tokens[row]`` (a decode plan: every sequence; an extend plan: the decodes
    # that ride along, before the prefill sequences whose tokens ``new_tokens`` lists)
    tokens_on_device: bool = False
    # some sequence samples with a temperature: every rank gathers the full logits (a
    # collective); greedy steps take the argmax without gathering them
    gather_logits: bool = False
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def num_device_tokens(self) -> int:
        """Sequences whose one new token is read on the device (the leading ones)."""
        return self.batch_size - len(self.new_tokens) if self.tokens_on_device else 0

    def host_tokens(self, seq: int) -> list[int]:
        """The new tokens of sequence ``seq``, one with a host token list."""
        return self.new_tokens[seq - self.num_device_tokens]


class RequestTable:
    """The device-side request-to-token table of one rank."""

    def __init__(self, num_rows: int, context_len: int, device: torch.device) -> None:
        self.context_len = context_len
        self.pad_row = num_rows
        self.table = torch.zeros(num_rows + 1, context_len, dtype=torch.int64, device=device)
        self.last_tokens = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        self.device = device

    def record(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """In place: ``table[rows[i], positions[i]] = slots[i]`` (new tokens' slots; one index_put)."""
        self.table[rows, positions] = slots

    def commit_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """In place: ``last_tokens[rows[i]] = tokens[i]`` (the sampled next token of each row)."""
        self.last_tokens[rows] = tokens

    def apply(self, plan: StepPlan, whole_table: bool = False) -> tuple[ForwardBatch, torch.Tensor]:
        """Record the plan's new slots in the table (in place) and build its batch, whose
        ``req_to_token`` is the plan's rows gathered, as wide as its longest sequence, or with
        ``whole_table`` the whole table read through ``row_ids`` (as a decode graph reads it, so
        that kernels launched from its width see one shape whatever the step); returns it and
        the plan's rows on the device. An extend plan's leading sequences whose tokens are read
        on the device are its decodes (``num_decodes``). All the plan's integers travel to the
        device in one copy."""
        check_token_source(plan)
        rows, cols, slots = [], [], []
        for row, new, seq_len in zip(plan.rows, plan.new_slots, plan.seq_lens):
            if seq_len > self.context_len:
                raise ValueError(f"sequence of {seq_len} tokens exceeds the context length {self.context_len}")
            rows.extend([row] * len(new))
            cols.extend(range(seq_len - len(new), seq_len))
            slots.extend(new)
        input_ids = [t for toks in plan.new_tokens for t in toks]
        extend_lens = [len(s) for s in plan.new_slots]
        fields = (input_ids, cols, slots, rows, plan.seq_lens, extend_lens, plan.rows)
        # every field padded to an even length, so that each starts 16-byte aligned whatever the
        # counts: the kernels that read them see one pointer-alignment class (one compile)
        lengths = [len(f) for f in fields]
        padded = [n + n % 2 for n in lengths]
        host = torch.tensor([v for f, p in zip(fields, padded) for v in [*f, *[0] * (p - len(f))]], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        packed = torch.split(host.to(self.device, non_blocking=True), padded)
        input_ids_t, positions, slot_mapping, rows_t, seq_lens, extend_lens_t, plan_rows = (
            t[:n] for t, n in zip(packed, lengths))
        self.record(rows_t, positions, slot_mapping)
        on_device = plan.num_device_tokens
        if on_device == plan.batch_size:
            input_ids_t = self.last_tokens[plan_rows]
        elif on_device:
            input_ids_t = torch.cat([self.last_tokens[plan_rows[:on_device]], input_ids_t])
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE if plan.kind == "decode" else ForwardMode.EXTEND,
            input_ids=input_ids_t,
            positions=positions,
            seq_lens=seq_lens,
            extend_lens=extend_lens_t,
            slot_mapping=slot_mapping,
            req_to_token=self.table if whole_table else self.table[plan_rows, :max(plan.seq_lens)],
            row_ids=plan_rows if whole_table else None,
            max_extend_len=max(extend_lens),
            num_decodes=on_device if plan.kind == "extend" else 0,
        )
        return batch, plan_rows


def check_token_source(plan: StepPlan) -> None:
    """ValueError unless every sequence's tokens come from exactly one place: one host token list
    per sequence, or ``tokens_on_device`` for a decode plan without host tokens, or for an
    extend plan whose leading sequences (at least one, not all) have no host token list and one
    new slot each."""
    if not plan.tokens_on_device:
        if len(plan.new_tokens) != plan.batch_size:
            raise ValueError(f"the plan has {plan.batch_size} rows but {len(plan.new_tokens)} token lists")
    elif plan.kind == "decode":
        if plan.new_tokens:
            raise ValueError(f"tokens_on_device is for decode plans without host tokens, got "
                             f"{len(plan.new_tokens)} token lists")
    elif plan.kind != "extend" or not 0 < plan.num_device_tokens < plan.batch_size:
        raise ValueError(f"tokens_on_device in a {plan.kind!r} plan needs host tokens for some but not all of its "
                         f"{plan.batch_size} sequences, got {len(plan.new_tokens)} token lists")
    elif any(len(s) != 1 for s in plan.new_slots[:plan.num_device_tokens]):
        raise ValueError("a sequence whose token is read on the device has exactly one new slot")


DECODE_FIELDS = ("input_ids", "positions", "seq_lens", "slot_mapping", "row_ids")


class DecodeBuffers:
    """The static inputs of decode steps of ``size`` sequences (a CUDA graph's padded batch):
    one ``[len(DECODE_FIELDS), size]`` int64 device buffer whose rows are the steps' input_ids,
    positions, seq_lens, slot_mapping and row_ids, and ``batch``, a decode `ForwardBatch` of views
    of it that reads the whole request table through row_ids (no ``[B, context]`` gather).
    Rows past a step's sequences pad: the table's padding row, length 1, position 0, slot 0
    (the scratch slot), token 0."""

    def __init__(self, table: RequestTable, size: int) -> None:
        self.table = table
        self.size = size
        self.packed = torch.empty(len(DECODE_FIELDS), size, dtype=torch.int64, device=table.device)
        self.packed.copy_(self._host(StepPlan("decode")))
        input_ids, positions, seq_lens, slot_mapping, row_ids = self.packed.unbind(0)
        extend_lens = torch.ones(size, dtype=torch.int64, device=table.device)
        self.batch = ForwardBatch(ForwardMode.DECODE, input_ids, positions, seq_lens, extend_lens, slot_mapping,
                                  req_to_token=table.table, row_ids=row_ids)

    def load(self, plan: StepPlan) -> None:
        """Fill the buffer for a decode plan of at most ``size`` sequences with one host-to-device
        copy (from pinned memory on a GPU), then record its new slots in the table (one
        index_put); with ``tokens_on_device``, gather the rows' last committed tokens into the
        input ids (one more launch). In place, no host sync."""
        self.packed.copy_(self._host(plan), non_blocking=True)
        bs, batch = plan.batch_size, self.batch
        self.table.record(batch.row_ids[:bs], batch.positions[:bs], batch.slot_mapping[:bs])
        if plan.tokens_on_device:
            torch.index_select(self.table.last_tokens, 0, batch.row_ids[:bs], out=batch.input_ids[:bs])

    def _host(self, plan: StepPlan) -> torch.Tensor:
        """The buffer's contents for ``plan``, padded, on the host."""
        if plan.kind != "decode" or plan.batch_size > self.size:
            raise ValueError(f"need a decode plan of at most {self.size} sequences, got {plan.kind!r} "
                             f"of {plan.batch_size}")
        check_token_source(plan)
        if any(len(t) != 1 for t in plan.new_tokens) or any(len(s) != 1 for s in plan.new_slots):
            raise ValueError("a decode plan has exactly one new token and one new slot per sequence")
        if any(not 1 <= n <= self.table.context_len for n in plan.seq_lens):
            raise ValueError(f"sequence lengths must be in [1, {self.table.context_len}], got {plan.seq_lens}")
        pad = self.size - plan.batch_size
        tokens = [0] * plan.batch_size if plan.tokens_on_device else [t for (t,) in plan.new_tokens]
        values = (tokens + [0] * pad
                  + [n - 1 for n in plan.seq_lens] + [0] * pad
                  + list(plan.seq_lens) + [1] * pad
                  + [s for (s,) in plan.new_slots] + [0] * pad
                  + list(plan.rows) + [self.table.pad_row] * pad)
        pinned = self.table.device.type == "cuda"
        return torch.tensor(values, dtype=torch.int64, pin_memory=pinned).view(len(DECODE_FIELDS), self.size)
