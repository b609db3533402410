"""The cost of one forward step: how long it takes (`StepTimer`), a model of that time
(`StepCost`) and its measurement at start-up (`measure_step_cost`).

Model: a step of T new tokens (decode tokens and prompt tokens together) lasts

    seconds(T) = fixed_s + per_token_s * T

``fixed_s`` is what a step costs whatever its size (reading every weight once, launches, the
host's work); ``per_token_s`` what each token adds (its matmuls, its attention over its context,
so it grows with the context). The scheduler sizes its steps from it (`engine.scheduling.step_budget`).

Timing: on a CPU a step runs synchronously, so its time is the wall time of the calls; on a GPU
the host runs ahead of the device (the overlap schedule), so a step is timed by two CUDA events
around its work, read once its tokens have reached the host (both events have completed then).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from arfusion.engine.runtime.model_runner import ModelRunner
from arfusion.engine.runtime.step_plan import StepPlan
from arfusion.engine.runtime.warm_up import SCRATCH_SLOT, run_plans

MIN_MEASURED_TOKENS = 16  # the start-up measurement goes at least this far


@dataclass(frozen=True)
class StepCost:
    """``seconds(T) = fixed_s + per_token_s * T`` (module docstring); both >= 0, per_token_s > 0.
    ``largest_step``: the most tokens of a step it was measured on (0: not measured)."""

    fixed_s: float
    per_token_s: float
    largest_step: int = 0

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    @staticmethod
    def fit(tokens: Sequence[int], seconds: Sequence[float]) -> "StepCost":
        """The least-squares line through ``(tokens[i], seconds[i])`` (at least two distinct token
        counts), its intercept clipped to [0, min(seconds)] and its slope to at least 1 ns."""
        if len(set(tokens)) < 2 or len(tokens) != len(seconds):
            raise ValueError(f"need steps of at least two sizes with one time each, got {list(tokens)}, {list(seconds)}")
        n = len(tokens)
        mean_t, mean_s = sum(tokens) / n, sum(seconds) / n
        var = sum((t - mean_t) ** 2 for t in tokens)
        slope = sum((t - mean_t) * (s - mean_s) for t, s in zip(tokens, seconds)) / var
        per_token = max(slope, 1e-9)
        fixed = min(max(mean_s - per_token * mean_t, 0.0), min(seconds))
        return StepCost(fixed, per_token, max(tokens))


class StepTiming:
    """The time of one step: `end` when its work has been issued, `seconds` once its outputs have
    reached the host."""

    def __init__(self, device: torch.device) -> None:
        self._events: Optional[tuple[torch.cuda.Event, torch.cuda.Event]] = None
        self._start, self._end = time.perf_counter(), 0.0
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def end(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float:
        """The step's time; on a GPU this waits for its end event (complete once its tokens are on the host)."""
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._end - self._start


class StepTimer:
    """Times the steps of one device: ``timing = timer.begin()`` before a step's work,
    ``timing.end()`` after it (`StepTiming`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self) -> StepTiming:
        return StepTiming(self.device)


def measure_step_cost(runner: ModelRunner, max_tokens: int, target_s: float, repeats: int = 2) -> StepCost:
    """Collective, on TP rank 0 before serving, while the other ranks wait in their plan loop:
    time prefill steps of 1, 2, 4, ... tokens (one fresh prompt each, on the scratch slot like the
    warm-up; each size ``repeats`` times, its fastest kept), up to ``max_tokens`` tokens or the
    first size of at least `MIN_MEASURED_TOKENS` that lasts ``target_s`` and twice as long as one
    token (so that the per-token cost shows above the noise), and fit a `StepCost` to them.
    Leaves the request table and every KV slot but the scratch slot as they were."""
    sizes: list[int] = []
    times: list[float] = []
    limit = min(max_tokens, runner.context_len)
    tokens = 1
    while True:
        ids = [(7 * i + 3) % runner.config.vocab_size for i in range(tokens)]
        plan = StepPlan("extend", rows=[runner.table.pad_row], new_tokens=[ids], new_slots=[[SCRATCH_SLOT] * tokens],
                        seq_lens=[tokens])
        sizes.append(tokens)
        times.append(min(run_plans(runner, [plan] * repeats)))
        if tokens >= limit or (tokens >= MIN_MEASURED_TOKENS and times[-1] >= max(target_s, 2 * times[0])):
            break
        tokens = min(2 * tokens, limit)
    if len(sizes) == 1:  # one token is the most a step can take
        return StepCost(0.0, times[0], 1)
    return StepCost.fit(sizes, times)
