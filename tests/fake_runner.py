"""`FakeRunner`: a `ModelRunner` stand-in for scheduler tests (TP1, CPU, no model): the next
token of a sequence is (its length mod 200) + 10, so outputs follow from the plans alone. Like
the real runner it keeps a `StepProgress` (a step begins in `forward`, ends in `commit_tokens`);
``hold_at`` makes that forward step block until ``release`` is set (a step that never finishes,
for the ``--dist-timeout`` watchdog)."""
from __future__ import annotations

import threading
import types
from typing import Callable

import torch

from arfusion.engine.common.generation import GenerationChunk
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.model_runner import RunnerLimits
from arfusion.engine.runtime.sampler import StepLogits
from arfusion.engine.runtime.step_plan import RequestTable, StepPlan
from arfusion.engine.runtime.step_progress import StepProgress
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.scheduler import Scheduler
from arfusion.fusion import AllReduceFusion, FusionConfig
from arfusion.fusion.group import TensorParallelGroup

VOCAB = 264


class FakeRunner:
    """Logits that always prefer token (position mod 200) + 10; optionally fails at step N.
    Records every step's plan, input tokens, (kind, batch size) and ``gather_logits``."""

    def __init__(self, fail_at: int = -1, rows: int = 4, slots: int = 64, context_len: int = 32,
                 hold_at: int = -1) -> None:
        self.group = TensorParallelGroup(0, 1, torch.device("cpu"))
        self.fusion = AllReduceFusion(self.group, FusionConfig(), 8, torch.float32)  # TP1: off
        self.fusion.setup()
        self.num_kv_slots, self.max_rows, self.context_len = slots, rows, context_len
        self.config = types.SimpleNamespace(eos_token_ids=(), vocab_size=VOCAB)
        self.device = torch.device("cpu")
        self.deterministic = False  # as ModelRunner: batch-invariant mode (the server reports it)
        self.table = RequestTable(rows, self.context_len, torch.device("cpu"))
        self.fail_at, self.calls, self.batch_sizes = fail_at, 0, []
        self.hold_at, self.release = hold_at, threading.Event()
        self.progress = StepProgress(self.device)
        self.plans: list[StepPlan] = []
        self.inputs: list[list[int]] = []  # each step's input tokens
        self.gathered: list[bool] = []  # each step's plan.gather_logits
        self._rows = None

    @property
    def limits(self) -> RunnerLimits:
        return RunnerLimits(self.max_rows, self.context_len, self.num_kv_slots, VOCAB, ())

    def raise_if_failed(self) -> None:
        self.fusion.raise_if_failed()

    def forward(self, plan: StepPlan) -> StepLogits:
        self.calls += 1
        self.progress.begin()
        if self.calls == self.hold_at:
            self.release.wait()
        if self.calls == self.fail_at:
            raise RuntimeError("injected forward failure")
        batch, self._rows = self.table.apply(plan)
        self.plans.append(plan)
        self.inputs.append(batch.input_ids.tolist())
        self.batch_sizes.append((plan.kind, plan.batch_size))
        self.gathered.append(plan.gather_logits)
        logits = torch.zeros(plan.batch_size, VOCAB)
        for i, seq_len in enumerate(plan.seq_lens):
            logits[i, seq_len % 200 + 10] = 1.0
        return StepLogits(logits.argmax(-1), logits if plan.gather_logits else None)

    def commit_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        self.table.commit_tokens(self._rows, tokens)
        self.progress.end()
        return tokens


def collect() -> tuple[list[GenerationChunk], Callable[[GenerationChunk], None]]:
    """A list of a request's chunks and the ``emit`` that appends to it."""
    chunks: list[GenerationChunk] = []
    return chunks, chunks.append


def serve_all(scheduler: Scheduler, requests: list[tuple[list[int], SamplingParams]]) -> list[list[GenerationChunk]]:
    """Submit every (prompt, params) at once and step until the scheduler is idle; each
    request's chunks, in order."""
    outs = [collect() for _ in requests]
    for (prompt, params), (_, emit) in zip(requests, outs):
        scheduler.submit(Request(prompt, params, emit=emit))
    scheduler._drain_inbox(block=False)
    while scheduler.step():
        pass
    return [chunks for chunks, _ in outs]


def token_ids(chunks: list[GenerationChunk]) -> list[int]:
    """The tokens a request's chunks carried, in order."""
    return [t for c in chunks for t in c.token_ids]
