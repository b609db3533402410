"""`SchedulePolicy` alone (no runner, no thread): the plans it hands out, step by step, with and
without chunked prefill, and the KV slots and rows it frees."""
import random

import pytest

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.policy import SchedulePolicy
from arfusion.engine.scheduling.request import Request


def _requests(lens: list[int], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(1, 200) for _ in range(n)], SamplingParams(max_tokens=3), emit=lambda _: None)
            for n in lens]


@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_prefill_mixes_decodes_with_prompt_chunks(seed: int):
    policy = SchedulePolicy(num_kv_slots=128, max_rows=2, context_len=64, max_prefill_tokens=32,
                            chunked_prefill_size=8)
    a, b, c = _requests([5, 11, 4], seed)
    policy.waiting.extend([a, b, c])
    plan, reqs = policy.next_step()
    assert plan.kind == "extend" and reqs == [a, b] and plan.new_tokens == [a.prompt_ids, b.prompt_ids[:3]]
    assert (a.prefilled, b.prefilled) == (5, 3) and list(policy.waiting) == [c], "two rows: c waits"
    a.tokens_in_flight = 1  # a's first token was sampled by that step
    plan, reqs = policy.next_step()
    assert reqs == [a, b] and plan.new_tokens == [b.prompt_ids[3:10]], "a decodes, b's next chunk fills the step"
    assert plan.seq_lens == [6, 10] and plan.tokens_on_device
    policy.retire(a)
    assert a.row is None and policy.running == [b] and policy.rows.available == 1
    plan, reqs = policy.next_step()
    assert reqs == [b, c] and plan.new_tokens == [b.prompt_ids[10:], c.prompt_ids], "c is admitted into a's row"


@pytest.mark.parametrize("seed", [0, 1])
def test_without_chunking_whole_prompts_fill_the_prefill_budget_then_decode(seed: int):
    policy = SchedulePolicy(num_kv_slots=128, max_rows=4, context_len=64, max_prefill_tokens=12)
    a, b, c = _requests([5, 6, 9], seed)
    policy.waiting.extend([a, b, c])
    plan, reqs = policy.next_step()
    assert plan.kind == "extend" and reqs == [a, b] and list(policy.waiting) == [c], "c does not fit the budget"
    plan, reqs = policy.next_step()
    assert reqs == [c] and plan.new_tokens == [c.prompt_ids]
    for req in (a, b, c):
        req.tokens_in_flight = 1
    plan, reqs = policy.next_step()
    assert plan.kind == "decode" and reqs == [a, b, c] and plan.seq_lens == [6, 7, 10]
    for req in (a, b, c):
        policy.retire(req)
    assert policy.slots.available == 127 and policy.rows.available == 4 and policy.next_step() == (None, [])


def test_a_request_that_can_never_fit_is_refused_with_its_numbers():
    policy = SchedulePolicy(num_kv_slots=16, max_rows=2, context_len=64, max_prefill_tokens=32)
    with pytest.raises(ValueError, match="needs 21 KV slots; the cache has 15"):
        policy.check_fits(Request(list(range(1, 20)), SamplingParams(max_tokens=3), emit=lambda _: None))
    with pytest.raises(ValueError, match="exceeds the context length 64"):
        policy.check_fits(Request(list(range(1, 63)), SamplingParams(max_tokens=3), emit=lambda _: None))


@pytest.mark.parametrize("seed", [0, 1])
def test_short_prompts_join_ahead_of_a_prompt_in_progress_which_keeps_half_of_every_step(seed: int):
    policy = SchedulePolicy(num_kv_slots=512, max_rows=8, context_len=256, max_prefill_tokens=256,
                            chunked_prefill_size=16)
    long, = _requests([200], seed)
    policy.waiting.append(long)
    plan, reqs = policy.next_step()
    assert reqs == [long] and long.prefilled == 16
    other_long, short, too_long_to_jump, second_short = _requests([100, 5, 9, 3], seed + 10)
    policy.waiting.extend([other_long, short, too_long_to_jump, second_short])
    plan, reqs = policy.next_step()
    assert reqs == [long, short, second_short], "the short prompts (together within half the step) join"
    assert plan.new_tokens == [long.prompt_ids[16:24], short.prompt_ids, second_short.prompt_ids]
    assert list(policy.waiting) == [other_long, too_long_to_jump], "longer prompts wait their turn"
    for req in (short, second_short):
        policy.retire(req)
    while not long.prefill_done:  # a short prompt every step: the prompt in progress still gets half
        before = long.prefilled
        policy.waiting.append(_requests([8], seed + long.prefilled)[0])
        plan, reqs = policy.next_step()
        assert long.prefilled - before == min(8, len(long.prompt_ids) - before), "half of every step"
        for req in reqs[1:]:
            policy.retire(req)
