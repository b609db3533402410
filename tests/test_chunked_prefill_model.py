"""Chunked, mixed prefill with the tiny model at TP1 and TP2 (gloo, fused reductions on the
torch backend): the scheduler's outputs equal the unchunked schedule's bit for bit, with and
without the overlap schedule, for greedy requests and a seeded sampled one, with chunks that
split prompts over several steps while decodes ride along; and in every chunked step each
running request that wants a token gets one."""
import pytest
import torch

from tests.dist_utils import run_distributed

PROMPT_LENS = (5, 40, 90, 17, 61)
MAX_TOKENS = (12, 6, 9, 10, 7)
SAMPLED = 3  # this request samples with a temperature and a seed
CHUNK = 24
SCHEDULES = [(-1, False), (-1, True), (CHUNK, False), (CHUNK, True), (7, True)]  # (chunked_prefill_size, overlap)


def _serve(runner, chunk: int, overlap: bool) -> tuple[list[list[int]], bool, int]:
    """Rank 0: every request submitted at once (four rows: the fifth joins while others decode).
    Returns each request's tokens, whether every step ran a decode token of each running request
    that wanted one, and the number of steps that carried prompt tokens."""
    from arfusion.engine.common.sampling_params import SamplingParams
    from arfusion.engine.scheduling.request import Request
    from arfusion.engine.scheduling.scheduler import Scheduler
    from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer

    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=256, overlap=overlap, chunked_prefill_size=chunk)
    g = torch.Generator().manual_seed(7)
    outs: list[list] = [[] for _ in PROMPT_LENS]
    for i, (n, max_tokens) in enumerate(zip(PROMPT_LENS, MAX_TOKENS)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.9 if i == SAMPLED else 0, seed=5,
                                ignore_eos=True)
        s.submit(Request(torch.randint(0, runner.config.vocab_size, (n,), generator=g).tolist(), params,
                         emit=outs[i].append))
    s._drain_inbox(block=False)
    plans = []
    forward = runner.forward
    runner.forward = lambda plan: (plans.append(plan), forward(plan))[1]
    rides_along, prompt_steps = True, 0
    try:
        while True:
            wanting = {r.row for r in s.policy.running if r.wants_decode_step}
            before = len(plans)
            if not s.step():
                break
            if len(plans) > before:
                plan = plans[-1]
                decoded = plan.rows if plan.kind == "decode" else plan.rows[:plan.num_device_tokens]
                rides_along &= wanting <= set(decoded)
                prompt_steps += plan.kind == "extend"
    finally:
        del runner.forward
    assert s.policy.slots.available == runner.num_kv_slots - 1 and not s.policy.running
    return [[t for c in chunks for t in c.token_ids] for chunks in outs], rides_along, prompt_steps


def _schedules(rank: int, world_size: int) -> dict:
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group
    from tests.plan_follower import follow_plans

    settings = RunnerSettings(model_path="tiny", context_length=256, max_running_requests=4, kv_slots=1024,
                              fusion=FusionConfig(enabled=True, backend="torch"))
    runner = build_runner(settings, get_tp_group())
    try:
        if rank != 0:
            return {"steps": follow_plans(runner)}
        results = {schedule: _serve(runner, *schedule) for schedule in SCHEDULES}
        if world_size > 1:
            from arfusion.engine.runtime.step_plan import StepPlan
            runner.group.broadcast_object(StepPlan("shutdown"))
        return results
    finally:
        runner.destroy()


@pytest.mark.parametrize("world_size", [1, 2])
def test_chunked_mixed_prefill_gives_the_unchunked_outputs_bit_for_bit(world_size: int):
    results = run_distributed(_schedules, world_size=world_size, timeout_s=240)[0]
    reference, unchunked_rides_along, unchunked_prompt_steps = results[(-1, False)]
    assert [len(t) for t in reference] == list(MAX_TOKENS)
    assert len({t for tokens in reference for t in tokens}) > 5, "the tokens vary"
    assert not unchunked_rides_along, "without chunking, prefill steps stop the running decodes"
    for (chunk, overlap), (tokens, rides_along, prompt_steps) in results.items():
        assert tokens == reference, (chunk, overlap)
        if chunk > 0:
            assert rides_along, f"a step of chunk {chunk} left out a running request's decode"
            assert prompt_steps > unchunked_prompt_steps, "prompts were prefilled in several chunks"
