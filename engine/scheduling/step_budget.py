"""`StepBudget`: how many prompt tokens the next mixed step (decodes plus prompt chunks) may take,
so that a step lasts about a target time and no long prompt holds the running requests (or a
new short request) for longer.

From the cost model of `engine.runtime.step_cost` (``seconds(T) = fixed_s + per_token_s * T``
for T new tokens), a step with D decode tokens takes

    P = (target_s - fixed_s) / per_token_s - D

prompt tokens, at least ``fixed_s / per_token_s`` (where a step's fixed cost exceeds the target,
as for a large model on a few CPU cores, its prompt tokens still cost at least as much as that
fixed part: such a step lasts at most 2 * fixed_s, and at least half of every step is useful
work) and `MIN_PROMPT_TOKENS`, and at most ``max_tokens - D`` (the token bound of a step,
``--chunked-prefill-size``, which decodes fill first).

The estimates start from the measurement at start-up (`start_from`) or, without one, from
`INITIAL_PROMPT_TOKENS` per step, and follow every step's measured time (`observe`, an
exponential moving average with weight `SMOOTHING`): a step without prompt tokens updates
``fixed_s`` (and turns the line about the last prompt step's size, so that the time it predicts
for such a step stays), a step with prompt tokens ``per_token_s``. A step takes at most `GROWTH` times the
prompt tokens of the last measured step with prompt tokens (or of the largest step measured at
start-up), so that an estimate from short steps is never extrapolated to one huge step. Since per_token_s grows with the context
(attention), the budget of a long prompt's later chunks shrinks as its context grows. Whatever
estimate of ``fixed_s`` below a step's time t, steps sized this way converge to lasting
``target_s``: after a step of T tokens that took t, the next may take
T * (target_s - fixed_s) / (t - fixed_s) tokens (without smoothing).
"""
from __future__ import annotations

from typing import Optional

from arfusion.engine.runtime.step_cost import StepCost

MIN_PROMPT_TOKENS = 16  # a step with room for prompt tokens takes at least these many (progress)
INITIAL_PROMPT_TOKENS = 64  # per step before any step has been measured
SMOOTHING = 0.5  # weight of the newest step in the estimates
GROWTH = 4  # a step takes at most this many times the prompt tokens of the last measured one


class StepBudget:
    def __init__(self, max_tokens: int, target_s: float = 0.0) -> None:
        """``max_tokens``: most tokens of a step (decodes and prompt); ``target_s``: the target
        duration of a step, 0 for none (every step may take ``max_tokens``)."""
        if max_tokens < 1 or target_s < 0:
            raise ValueError(f"a step budget needs max_tokens >= 1 and target_s >= 0, got {max_tokens}, {target_s}")
        self.max_tokens = max_tokens
        self.target_s = target_s
        self.cost: Optional[StepCost] = None
        self.measured_prompt = INITIAL_PROMPT_TOKENS  # prompt tokens of the last measured step with some
        self._pivot = 1  # tokens of that step (or of the largest measured at start-up)

    def start_from(self, cost: StepCost) -> None:
        """Take ``cost`` (measured at start-up, on steps of up to ``cost.largest_step`` tokens)
        as the current estimate."""
        self.cost = cost
        self.measured_prompt = self._pivot = max(cost.largest_step, 1)

    def prompt_tokens(self, decodes: int) -> int:
        """Prompt tokens the next step may take beside ``decodes`` decode tokens (module docstring)."""
        room = self.max_tokens - decodes
        if room <= 0 or not self.target_s:
            return max(room, 0)
        if self.cost is None:
            return min(room, INITIAL_PROMPT_TOKENS)
        fixed, per_token = self.cost.fixed_s, self.cost.per_token_s
        within_target = (self.target_s - fixed) / per_token - decodes
        want = max(within_target, fixed / per_token, MIN_PROMPT_TOKENS)
        return int(min(room, want, max(GROWTH * self.measured_prompt, MIN_PROMPT_TOKENS)))

    def observe(self, tokens: int, prompt_tokens: int, seconds: float) -> None:
        """A step of ``tokens`` new tokens, ``prompt_tokens`` of them from prompts, took ``seconds``."""
        if not self.target_s or tokens <= 0 or seconds <= 0:
            return
        if self.cost is None:
            # the first measured step: its time split evenly between fixed and per-token cost
            self.cost = StepCost(seconds / 2, seconds / 2 / tokens, tokens)
            self._pivot = tokens
            return
        fixed, per_token = self.cost.fixed_s, self.cost.per_token_s
        if prompt_tokens:
            self.measured_prompt, self._pivot = prompt_tokens, tokens
            per_token = _mix(per_token, max(seconds - fixed, seconds / 2) / tokens)
        else:
            # a new intercept, the line turned about the last prompt step's size (whose time it keeps)
            new_fixed = _mix(fixed, max(seconds - per_token * tokens, 0.0))
            per_token = max(per_token + (fixed - new_fixed) / self._pivot, per_token / 2)
            fixed = new_fixed
        self.cost = StepCost(fixed, per_token, max(self.cost.largest_step, tokens))


def _mix(old: float, new: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * new
