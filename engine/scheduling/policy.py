"""`SchedulePolicy`: what runs next on TP rank 0 (no threads, no device work): which waiting
requests are admitted, how prompts are chunked, and the `StepPlan` of the next step.

Admission: a waiting request joins while it fits (a free row, ``max_running_requests`` rows in
all, and KV slots for the prompt plus all of ``max_tokens``, reserved up front so a running
request never runs out). Requests join and leave between steps.

Steps, with chunked prefill (``chunked_prefill_size`` > 0, the server's default): every step
runs one decode token of every running request and, in the same forward (a mixed extend
batch), prompt tokens within the step's budget (`StepBudget`: sized so that the step lasts
about ``step_time_target_s``, and within ``min(chunked_prefill_size, max_prefill_tokens)``
tokens in all, decodes included). A prompt longer than what is left is prefilled in chunks over
several steps, so no running request misses a step while others are admitted. Which prompts:
while a prompt is being prefilled, waiting requests whose whole prompt fits half the step's
prompt budget join first (in arrival order; a short request's first token comes within a step
or two, however long the prompt in progress); then the prompts being prefilled continue, then
waiting requests are admitted while they fit (the first of them chunked). The prompt in progress
keeps at least half of every step, so no stream of short requests starves it. A chunk that does
not end its prompt samples nothing (its row of the step's requests is None). A step with no
prompt tokens is a plain decode step (a CUDA graph). Deterministic mode mixes them the same way:
there the attention of a mixed step runs its decode rows as a decode batch and its prompt
chunks as an extend batch (layers/attention.py), so a token's bits do not depend on whether
other requests were being prefilled when it was made.
Without chunking (``chunked_prefill_size`` <= 0): admit whole prompts as one prefill-only step
while they fit ``max_prefill_tokens`` (the first one whatever its length); otherwise run one
decode step over every running request.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from arfusion.engine.runtime.step_plan import PromptLogprobs, StepPlan
from arfusion.engine.scheduling.kv_pool import RowAllocator, SlotAllocator
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.step_budget import StepBudget


class SchedulePolicy:
    """The waiting and running requests and the KV slots and request rows they hold."""

    def __init__(self, num_kv_slots: int, max_rows: int, context_len: int, max_prefill_tokens: int,
                 chunked_prefill_size: int = -1, step_time_target_s: float = 0.0) -> None:
        self.context_len = context_len
        self.max_prefill_tokens = max_prefill_tokens
        # most tokens of a mixed step (decodes and prompt chunks); None: whole prompts, unmixed
        self.max_step_tokens = min(chunked_prefill_size, max_prefill_tokens) if chunked_prefill_size > 0 else None
        # prompt tokens of each mixed step (None without chunking)
        self.budget = StepBudget(self.max_step_tokens, step_time_target_s) if self.max_step_tokens else None
        self.slots = SlotAllocator(num_kv_slots)
        self.rows = RowAllocator(max_rows)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def check_fits(self, req: Request) -> None:
        """ValueError (naming the numbers) if ``req`` could never be admitted."""
        total = len(req.prompt_ids) + req.params.max_tokens
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if total > self.context_len:
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = {total} "
                             f"exceeds the context length {self.context_len}")
        if req.reserved_tokens > self.slots.num_slots - 1:
            raise ValueError(f"the request needs {req.reserved_tokens} KV slots; the cache has {self.slots.num_slots - 1}")

    @property
    def max_extend_tokens(self) -> int:
        """The most tokens an extend step can hold: a mixed step's size, or without chunking the
        prefill budget or a whole prompt admitted alone (at most the context length - 1)."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return max(self.max_prefill_tokens, self.context_len - 1)

    def next_step(self) -> tuple[Optional[StepPlan], list[Request]]:
        """The next step's plan and the request of each of its sequences (admitting waiting
        requests and advancing the prefilled prompts); (None, []) when nothing is due."""
        if self.max_step_tokens is not None:
            return self._plan_mixed()
        plan, reqs = self._plan_prefill()
        return (plan, reqs) if plan is not None else self._plan_decode()

    def retire(self, req: Request) -> None:
        """``req`` has finished, failed or was aborted: free its KV slots and row, drop it."""
        if req.row is not None:
            self.slots.free(req.slots)
            self.rows.free(req.row)
            req.row, req.slots = None, []
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def _plan_prefill(self) -> tuple[Optional[StepPlan], list[Request]]:
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and self.rows.available:
            req = self.waiting[0]
            prompt = len(req.prompt_ids)
            if admitted and prompt > budget:
                break
            slots = self.slots.allocate(req.reserved_tokens)
            if slots is None:
                break
            self._admit(req, slots)
            req.prefilled = prompt
            admitted.append(req)
            budget -= prompt
        if not admitted:
            return None, []
        plan = StepPlan("extend", rows=[r.row for r in admitted], new_tokens=[list(r.prompt_ids) for r in admitted],
                        new_slots=[r.slots[: len(r.prompt_ids)] for r in admitted],
                        seq_lens=[len(r.prompt_ids) for r in admitted], gather_logits=_needs_logits(admitted),
                        prompt_logprobs=_prompt_logprobs([(i, r, 0) for i, r in enumerate(admitted)]))
        return plan, admitted

    def _plan_decode(self) -> tuple[Optional[StepPlan], list[Request]]:
        """One decode step of every running request that still has tokens to launch; each reads
        its input (its latest token, perhaps still in flight) on the device."""
        reqs = [r for r in self.running if r.wants_decode_step]
        if not reqs:
            return None, []
        plan = StepPlan("decode", rows=[r.row for r in reqs], new_slots=[[r.slots[r.launched_len - 1]] for r in reqs],
                        seq_lens=[r.launched_len for r in reqs], tokens_on_device=True,
                        gather_logits=_needs_logits(reqs))
        return plan, reqs

    def _plan_mixed(self) -> tuple[Optional[StepPlan], list[Request]]:
        """One step of chunked prefill: a decode token of every running request that wants one
        (read on the device, first in the batch), then prompt chunks within the step's budget
        (the module docstring says which). Advances each chunk's ``prefilled``; a plain decode
        plan when there is no chunk."""
        assert self.budget is not None
        decodes = [r for r in self.running if r.wants_decode_step]
        budget = self.budget.prompt_tokens(len(decodes))
        prefilling = [r for r in self.running if not r.prefill_done]
        jumping = self._admit_short(budget // 2) if prefilling and budget > 0 else []
        budget -= sum(len(r.prompt_ids) for r in jumping)
        chunks: list[tuple[Request, int]] = []  # (request, its chunk's first prompt position)
        while budget > 0:
            if prefilling:
                req = prefilling.pop(0)
            elif self.waiting and self.rows.available and (
                    slots := self.slots.allocate(self.waiting[0].reserved_tokens)) is not None:
                req = self._admit(self.waiting[0], slots)
            else:
                break
            start = req.prefilled
            req.prefilled = min(len(req.prompt_ids), start + budget)
            budget -= req.prefilled - start
            chunks.append((req, start))
        chunks += [(r, 0) for r in jumping]
        for req in jumping:
            req.prefilled = len(req.prompt_ids)
        if not chunks:
            return self._plan_decode()
        prefills = [r for r, _ in chunks]
        plan = StepPlan("extend", rows=[r.row for r in decodes + prefills],
                        new_tokens=[r.prompt_ids[start:r.prefilled] for r, start in chunks],
                        new_slots=[[r.slots[r.launched_len - 1]] for r in decodes]
                        + [r.slots[start:r.prefilled] for r, start in chunks],
                        seq_lens=[r.launched_len for r in decodes] + [r.prefilled for r in prefills],
                        tokens_on_device=bool(decodes),
                        gather_logits=_needs_logits(decodes + [r for r in prefills if r.prefill_done]),
                        prompt_logprobs=_prompt_logprobs([(len(decodes) + i, r, start)
                                                          for i, (r, start) in enumerate(chunks)]))
        return plan, decodes + prefills

    def _admit_short(self, room: int) -> list[Request]:
        """Admit the waiting requests whose whole prompt fits ``room`` tokens (together, in
        arrival order, passing over longer ones), until one lacks a row or its KV slots."""
        admitted = []
        for req in list(self.waiting):
            if len(req.prompt_ids) > room:
                continue
            slots = self.slots.allocate(req.reserved_tokens) if self.rows.available else None
            if slots is None:
                break
            admitted.append(self._admit(req, slots))
            room -= len(req.prompt_ids)
        return admitted

    def _admit(self, req: Request, slots: list[int]) -> Request:
        """Move waiting ``req`` to the running ones with these KV slots and a free row."""
        self.waiting.remove(req)
        req.slots, req.row = slots, self.rows.allocate()
        self.running.append(req)
        return req


def _needs_logits(reqs: list[Request]) -> bool:
    """Whether a step of these requests needs the full logits (`SamplingParams.needs_full_logits`)."""
    return any(r.params.needs_full_logits for r in reqs)


def _prompt_logprobs(chunks: list[tuple[int, Request, int]]) -> list[PromptLogprobs]:
    """The plan's `PromptLogprobs` for its prefill chunks ``(sequence index, request, first
    position)`` (each request's ``prefilled`` already advanced past its chunk): those of requests
    that asked for them and whose chunk scores a prompt token."""
    specs = []
    for seq, req, start in chunks:
        k = req.params.prompt_logprobs
        end = req.prefilled
        next_token = req.prompt_ids[end] if end < len(req.prompt_ids) else -1
        if k is not None and (end - start > 1 or next_token >= 0):
            specs.append(PromptLogprobs(seq, k, next_token))
    return specs
