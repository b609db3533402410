"""A long prompt among running streams and a new short request, in the scheduler with the fake
model and a simulated clock: each step "lasts" ``FIXED_S + PER_TOKEN_S * tokens`` (the test's
cost model, read by the scheduler's step timer), so every time below follows from the plans.

With a step time target, every step stays within it (once the first step has been measured),
the running streams get a token every step, and a short request sent while the long prompt is
being prefilled gets its first token within three steps; without a target, one step holds the
whole long prompt and the short request waits for it."""
from __future__ import annotations

import pytest

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.step_plan import StepPlan
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.scheduler import Scheduler
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.fake_runner import FakeRunner, collect

FIXED_S, PER_TOKEN_S = 0.02, 0.001
TARGET_S = 0.1
LONG = 1500


def step_seconds(plan: StepPlan) -> float:
    return FIXED_S + PER_TOKEN_S * sum(len(s) for s in plan.new_slots)


class SimulatedTiming:
    def __init__(self, clock: "SimulatedClock") -> None:
        self.clock = clock
        self.elapsed = 0.0

    def end(self) -> None:
        self.elapsed = step_seconds(self.clock.runner.plans[-1])
        self.clock.now += self.elapsed

    def seconds(self) -> float:
        return self.elapsed


class SimulatedClock:
    """The scheduler's step timer: a step's time from its plan; ``now`` advances by each step."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.now = 0.0

    def begin(self) -> SimulatedTiming:
        return SimulatedTiming(self)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(target_s: float) -> dict:
    """Two streams decoding; the long prompt arrives, and during its first step a short request.
    Returns the steps' times, each stream's token times, and the short request's TTFT."""
    runner = FakeRunner(rows=4, slots=4096, context_len=2048)
    clock = SimulatedClock(runner)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=8192, chunked_prefill_size=8192,
                  step_time_target_s=target_s, timer=clock)
    token_times: list[list[float]] = [[], []]
    for times in token_times:
        s.submit(Request([1, 2, 3], greedy(400), emit=lambda chunk, t=times: t.extend([clock.now] * len(chunk.token_ids))))
    s._drain_inbox(block=False)
    while not all(token_times):
        s.step()
    long_out, emit_long = collect()
    s.submit(Request([20 + i % 200 for i in range(LONG)], greedy(1), emit=emit_long))
    s._drain_inbox(block=False)
    first = len(runner.plans)
    short_sent, short_first = clock.now, []  # it arrives while the long prompt's first step runs
    s.step()
    s.submit(Request([5, 6, 7, 8], greedy(2), emit=lambda chunk: short_first.append(clock.now)))
    s._drain_inbox(block=False)
    while not long_out:
        s.step()
    while not short_first:
        s.step()
    long_done = clock.now
    steps = [step_seconds(p) for p in runner.plans[first:]]
    gaps = [b - a for times in token_times for a, b in zip(times, times[1:]) if short_sent <= b <= long_done]
    return {"steps": steps, "gaps": gaps, "short_ttft": short_first[0] - short_sent, "long_done": long_done}


def test_steps_stay_within_the_target_and_a_short_request_starts_within_three_steps():
    result = run(TARGET_S)
    measured = result["steps"][2:]  # the first two steps were sized before any step was measured
    assert max(measured) <= TARGET_S + PER_TOKEN_S, result["steps"]
    assert len(result["steps"]) >= LONG * PER_TOKEN_S / TARGET_S, "the long prompt took many steps"
    # the step it was sent in, the step it joins, and the overlap schedule's one step of lag
    assert result["short_ttft"] <= 3 * (TARGET_S + PER_TOKEN_S), result
    assert max(result["gaps"]) <= TARGET_S + PER_TOKEN_S, "the streams got a token every step"


def test_without_a_target_the_long_prompt_holds_everyone_for_its_whole_prefill():
    result = run(0.0)
    whole = FIXED_S + PER_TOKEN_S * (LONG + 2)
    assert max(result["steps"]) == pytest.approx(whole), "one step prefilled the whole prompt"
    assert result["short_ttft"] >= whole, "the short request waited for it"
    assert max(result["gaps"]) >= whole, "so did the streams"
