"""Greedy decoding of a `StaticBatch` (the tiny model, TP2 over gloo) with the tokens fed on the
device (`ModelRunner.commit_tokens`, overlap on and off) gives the tokens of the host-fed loop
(argmax, to the host, into the next plan) on every rank."""
import torch

from tests.dist_utils import run_distributed

PROMPTS, PROMPT_LEN, STEPS = 3, 7, 6


def _decode_three_ways(rank: int, world_size: int) -> dict:
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group

    settings = RunnerSettings(model_path="tiny", context_length=64, max_running_requests=PROMPTS, kv_slots=512,
                              fusion=FusionConfig(enabled=True, backend="torch"))
    runner = build_runner(settings, get_tp_group())
    prompts = random_prompts(PROMPTS, PROMPT_LEN, runner.config.vocab_size, seed=3)
    host_fed = StaticBatch(runner, prompts, STEPS + 1)
    tokens = [torch.argmax(host_fed.prefill(gather_logits=True).full, -1).tolist()]
    for _ in range(STEPS):
        tokens.append(torch.argmax(host_fed.decode(tokens[-1], gather_logits=True).full, -1).tolist())
    out = {"host_fed": tokens}
    for overlap in (False, True):
        batch = StaticBatch(runner, prompts, STEPS + 1)
        first = batch.prefill_greedy().get()
        steps, arrivals = batch.decode_greedy(STEPS, overlap)
        out[f"overlap={overlap}"] = [first] + steps
        out[f"arrivals_sorted={overlap}"] = arrivals == sorted(arrivals) and len(arrivals) == STEPS
    # a greedy-only step commits without a broadcast, so rank 0 must commit the step's own greedy tokens
    StaticBatch(runner, prompts, 1).prefill()
    other = torch.zeros(PROMPTS, dtype=torch.int64) if rank == 0 else None
    try:
        runner.commit_tokens(other)
        out["other_tokens_refused"] = rank != 0
    except ValueError as exc:
        out["other_tokens_refused"] = rank == 0 and "greedy_tokens" in str(exc)
    runner.destroy()
    return out


def test_device_fed_greedy_decoding_matches_the_host_fed_loop_on_every_rank():
    results = run_distributed(_decode_three_ways, world_size=2, timeout_s=120)
    reference = results[0]["host_fed"]
    assert len({tuple(map(tuple, r["host_fed"])) for r in results}) == 1
    assert len({t for step in reference for t in step}) > 2, "the tokens vary (not a constant stream)"
    for rank, r in enumerate(results):
        for overlap in (False, True):
            assert r[f"overlap={overlap}"] == reference, (rank, overlap)
            assert r[f"arrivals_sorted={overlap}"]
        assert r["other_tokens_refused"], rank


def test_a_batch_past_the_kv_cache_is_refused_with_the_slots_it_needs():
    from types import SimpleNamespace

    import pytest

    from arfusion.engine.scheduling.static_batch import StaticBatch

    runner = SimpleNamespace(max_rows=8, num_kv_slots=100)  # slot 0 is scratch: 99 for tokens
    StaticBatch(runner, [[1] * 30, [2] * 28], 20)  # 50 + 48 slots fit
    with pytest.raises(ValueError, match=r"100 slots\) cannot hold this batch: its 3 sequences .* need 180 slots; "
                                         r"lower the batch"):
        StaticBatch(runner, [[1] * 40] * 3, 20)
