"""The start-up warm-up: its plans cover the shape classes within the server's limits and touch
only the padding row and the scratch KV slot; run at TP2 (rank 0 drives, rank 1 follows its
plan loop) it leaves the request table, every other KV slot and the scheduler's outputs as they
were; the start-up line reports each phase."""
import logging

import pytest
import torch

from arfusion.engine.runtime.warm_up import SCRATCH_SLOT, WarmUpShapes, warm_up, warm_up_plans
from tests.dist_utils import run_distributed

GPU_LIKE = WarmUpShapes(context_len=8192, max_extend_tokens=8192, max_decode_batch=512, graph_max_batch=256,
                        ladder=True, pad_row=512, vocab_size=128256)
CPU_LIKE = WarmUpShapes(context_len=2048, max_extend_tokens=8192, max_decode_batch=256, graph_max_batch=0,
                        ladder=False, pad_row=256, vocab_size=264)


def _tokens(plan) -> int:
    return sum(len(s) for s in plan.new_slots)


@pytest.mark.parametrize("shapes", [GPU_LIKE, CPU_LIKE, WarmUpShapes(16, 4, 2, 0, True, 2, 264)])
def test_plans_stay_within_the_limits_and_touch_only_the_padding_row_and_the_scratch_slot(shapes):
    plans = warm_up_plans(shapes)
    assert plans == warm_up_plans(shapes), "deterministic"
    for plan in plans:
        assert set(plan.rows) == {shapes.pad_row} and {s for slots in plan.new_slots for s in slots} == {SCRATCH_SLOT}
        assert max(plan.seq_lens) <= shapes.context_len and plan.batch_size <= shapes.max_decode_batch
        assert _tokens(plan) <= (shapes.max_decode_batch if plan.kind == "decode" else shapes.max_extend_tokens)
        assert all(0 <= t < shapes.vocab_size for tokens in plan.new_tokens for t in tokens)
    assert any(p.kind == "extend" for p in plans) and any(p.gather_logits for p in plans)


def test_plans_cover_every_token_bucket_mixed_batches_eager_decodes_and_sampling():
    plans = warm_up_plans(GPU_LIKE)
    extend_tokens = {_tokens(p) for p in plans if p.kind == "extend"}
    for k in range(14):
        assert {t for t in (2 ** k, 2 ** k - 1, 2 ** k - 2) if t >= 1} <= extend_tokens, k
    mixed = [p for p in plans if p.kind == "extend" and p.tokens_on_device]
    assert {p.batch_size % 2 for p in mixed} == {0, 1} and any(p.gather_logits for p in mixed)
    assert all(p.seq_lens[-1] > len(p.new_tokens[-1]) for p in mixed), "the chunk has a cached prefix"
    decodes = {(p.batch_size, p.seq_lens[0], p.gather_logits) for p in plans if p.kind == "decode"}
    assert {(257, 16, False), (257, 17, False), (512, 16, False), (512, 17, False)} <= decodes, "past the graphs"
    assert {(1, 16, True), (512, 16, True)} <= decodes, "sampling at the smallest and largest batch"
    assert not {b for b, _, gather in decodes if not gather} & set(range(2, 257)), "graph sizes ran at capture"
    cpu = warm_up_plans(CPU_LIKE)
    assert max(_tokens(p) for p in cpu if p.kind == "extend") <= 32, "no token ladder where nothing compiles"
    assert {p.batch_size for p in cpu if p.kind == "decode"} == {1, 256}


def _state(runner) -> dict:
    return {"table": runner.table.table.clone(), "last_tokens": runner.table.last_tokens.clone(),
            "k": [k.clone() for k in runner.kv_cache.k], "v": [v.clone() for v in runner.kv_cache.v]}


def _unchanged_but_scratch(before: dict, after: dict) -> bool:
    same = torch.equal(before["table"], after["table"]) and torch.equal(before["last_tokens"], after["last_tokens"])
    return same and all(torch.equal(a[SCRATCH_SLOT + 1:], b[SCRATCH_SLOT + 1:])
                        for key in ("k", "v") for a, b in zip(before[key], after[key]))


def _serve(runner, scheduler) -> list[list[int]]:
    from arfusion.engine.common.sampling_params import SamplingParams
    from tests.fake_runner import serve_all, token_ids

    requests = [([(7 * i + 3 * j) % 264 for j in range(n)],
                 SamplingParams(max_tokens=6, temperature=0.8 if i == 1 else 0, seed=2, ignore_eos=True))
                for i, n in enumerate((9, 30, 4))]
    return [token_ids(chunks) for chunks in serve_all(scheduler, requests)]


def _warm_up_between_two_runs(rank: int, world_size: int) -> dict:
    """Serve, warm up and measure the step cost, serve again; rank 1 follows each phase's plans
    (a "shutdown" plan ends a phase) and compares its own state around the warm-up. Each rank
    returns the start-up progress lines it logged."""
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.runtime.step_cost import measure_step_cost
    from arfusion.engine.runtime.step_plan import StepPlan
    from arfusion.engine.scheduling.scheduler import Scheduler
    from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group
    from tests.plan_follower import follow_plans

    progress = ListHandler()
    logging.getLogger("arfusion.engine.progress").addHandler(progress)
    logging.getLogger("arfusion.engine.progress").setLevel(logging.INFO)
    settings = RunnerSettings(model_path="tiny", context_length=128, max_running_requests=3, kv_slots=512,
                              fusion=FusionConfig(enabled=True, backend="torch"))
    runner = build_runner(settings, get_tp_group())
    try:
        if rank != 0:
            follow_plans(runner)
            before = _state(runner)
            warm_up_steps = follow_plans(runner)
            clean = _unchanged_but_scratch(before, _state(runner))
            follow_plans(runner)
            return {"clean": clean, "warm_up_steps": warm_up_steps, "progress": progress.lines}
        tokenizer = build_tiny_tokenizer()
        scheduler = Scheduler(runner, tokenizer, max_prefill_tokens=64, chunked_prefill_size=16)
        first = _serve(runner, scheduler)
        runner.group.broadcast_object(StepPlan("shutdown"))
        before = _state(runner)
        warm_up(runner, scheduler.policy.max_extend_tokens)
        cost = measure_step_cost(runner, scheduler.policy.max_extend_tokens, target_s=10.0)
        runner.group.broadcast_object(StepPlan("shutdown"))
        clean = _unchanged_but_scratch(before, _state(runner))
        second = _serve(runner, Scheduler(runner, tokenizer, max_prefill_tokens=64, chunked_prefill_size=16))
        runner.group.broadcast_object(StepPlan("shutdown"))
        return {"clean": clean, "outputs": (first, second), "phases": list(runner.startup_s), "cost": cost,
                "progress": progress.lines}
    finally:
        runner.destroy()


def test_warm_up_at_tp2_leaves_the_state_and_the_outputs_as_they_were():
    rank0, rank1 = run_distributed(_warm_up_between_two_runs, world_size=2, timeout_s=180)
    first, second = rank0["outputs"]
    assert first == second and len({t for tokens in first for t in tokens}) > 3
    assert rank0["clean"] and rank1["clean"], "the table, last tokens and every KV slot but the scratch one"
    assert rank1["warm_up_steps"] > 10, "rank 1 ran rank 0's warm-up plans"
    assert rank0["phases"] == ["weights", "fusion setup", "KV cache", "graphs", "warm-up"]
    assert rank0["cost"].per_token_s > 0 and rank0["cost"].fixed_s >= 0, "measured on every size up to the chunk"
    assert rank0["progress"][0].startswith("loading weights: ") and "tensors" in rank0["progress"][0]
    assert any(line.startswith("loading weights: done, ") and " MB in " in line for line in rank0["progress"])
    assert any(line.startswith("warming up: done, ") for line in rank0["progress"])
    assert rank1["progress"] == [], "only rank 0 logs the start-up's progress"


class ListHandler(logging.Handler):
    """Keeps the messages of the records it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
