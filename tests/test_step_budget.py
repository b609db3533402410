"""`StepBudget` and `StepCost` alone: the prompt tokens of a step from a linear step cost, the
floor where a step's fixed cost exceeds the target, and the closed loop (steps sized by the
budget, their times observed) converging to steps of the target time. Every time here comes
from a cost model the test states; nothing is measured on this machine."""
import pytest

from arfusion.engine.runtime.step_cost import StepCost
from arfusion.engine.scheduling.step_budget import GROWTH, INITIAL_PROMPT_TOKENS, MIN_PROMPT_TOKENS, StepBudget


def test_a_line_is_fitted_exactly_and_a_fit_needs_two_sizes():
    cost = StepCost.fit([1, 2, 4, 8, 16], [0.05 + 0.002 * t for t in (1, 2, 4, 8, 16)])
    assert cost.fixed_s == pytest.approx(0.05) and cost.per_token_s == pytest.approx(0.002) and cost.largest_step == 16
    with pytest.raises(ValueError, match="two sizes"):
        StepCost.fit([4, 4], [0.1, 0.2])


@pytest.mark.parametrize("decodes", [0, 3, 40])
def test_the_prompt_tokens_of_a_step_fill_the_target_time(decodes: int):
    budget = StepBudget(max_tokens=8192, target_s=0.2)
    budget.start_from(StepCost(0.05, 0.001, largest_step=256))
    prompt = budget.prompt_tokens(decodes)
    assert prompt == 150 - decodes, "(0.2 - 0.05) / 0.001 tokens in all"
    assert budget.cost.seconds(prompt + decodes) == pytest.approx(0.2)


def test_where_the_fixed_cost_exceeds_the_target_prompt_tokens_cost_as_much_as_it():
    budget = StepBudget(max_tokens=8192, target_s=0.2)
    budget.start_from(StepCost(0.3, 0.01, largest_step=32))  # a 0.5B model on two CPU cores: a step costs 0.3 s whatever its size
    assert budget.prompt_tokens(2) == 30
    assert budget.cost.seconds(2 + budget.prompt_tokens(2)) <= 2 * 0.3 + 2 * 0.01
    budget.start_from(StepCost(0.0, 1.0, largest_step=1))
    assert budget.prompt_tokens(0) == MIN_PROMPT_TOKENS, "a step always makes progress"


def test_the_step_bound_caps_the_budget_and_no_target_means_the_bound():
    budget = StepBudget(max_tokens=100, target_s=0.2)
    budget.start_from(StepCost(0.0, 1e-5, largest_step=100))
    assert budget.prompt_tokens(10) == 90 and budget.prompt_tokens(100) == 0 and budget.prompt_tokens(130) == 0
    untimed = StepBudget(max_tokens=100)
    untimed.observe(50, 40, 3.0)
    assert untimed.prompt_tokens(10) == 90 and untimed.cost is None
    assert StepBudget(max_tokens=8192, target_s=0.2).prompt_tokens(5) == INITIAL_PROMPT_TOKENS, "nothing measured yet"
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        StepBudget(max_tokens=0)


def test_a_step_takes_at_most_growth_times_the_prompt_tokens_of_the_last_measured_one():
    budget = StepBudget(max_tokens=8192, target_s=0.2)
    budget.start_from(StepCost(0.001, 1e-6, largest_step=16))  # a start-up measurement far too optimistic
    assert budget.prompt_tokens(0) == GROWTH * 16
    budget.observe(3 + 10, 10, 0.01)  # a short prompt's step
    assert budget.prompt_tokens(3) == GROWTH * 10


@pytest.mark.parametrize("fixed,per_token,start", [(0.02, 0.0005, None), (0.08, 0.004, StepCost(0.001, 1e-6, 16)),
                                                   (0.01, 0.002, StepCost(0.1, 0.1, 4))])
def test_steps_sized_by_the_budget_converge_to_the_target_time(fixed, per_token, start):
    """The closed loop from a wrong start (or none): a long prompt's steps with 4 decodes and a
    decode-only step now and then; the step time is ``fixed + per_token * tokens``: after the
    first steps, none lasts longer than the target by more than one token's cost, and the last
    ones are within 2 % and one token's cost of it (the budget is a whole number of tokens)."""
    target = 0.2
    budget = StepBudget(max_tokens=8192, target_s=target)
    if start is not None:
        budget.start_from(start)
    times = []
    for step in range(40):
        prompt = 0 if step % 7 == 6 else budget.prompt_tokens(4)
        seconds = fixed + per_token * (4 + prompt)
        budget.observe(4 + prompt, prompt, seconds)
        if prompt:
            times.append(seconds)
    assert all(abs(t - target) <= 0.02 * target + per_token for t in times[-5:]), times
    assert max(times[10:]) <= target * 1.02 + per_token, times
