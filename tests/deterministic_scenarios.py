"""The scenarios of the engine-level batch-invariance tests (tests/test_deterministic_engine.py on
CPU, tests/gpu/test_deterministic_engine.py on the GPU): one target request (a fixed prompt,
greedy, a few tokens with their log-probabilities) alone, in batches of 2, 8 and 32 (the others:
random prompts of its length), among concurrent requests of other lengths (which join and leave
at other steps), and its prompt score (``echo``: the prompt's log-probabilities) alone, under
load, and prefilled in chunks of 64 tokens (the last chunk of 3: few rows, where a row-dependent
matmul changes bits) or whole (chunked prefill size 8192). `serve_scenarios` is the per-rank
worker: rank 0 runs every scenario through the scheduler, the other ranks follow its plans.
"""
from __future__ import annotations

from typing import Any

import torch

TARGET = torch.randint(0, 256, (67,), generator=torch.Generator().manual_seed(11)).tolist()
NEW_TOKENS = 4
BATCHES = (2, 8, 32)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(max_tokens: int = NEW_TOKENS) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 1}


SCORE = {"max_tokens": 0, "temperature": 0, "prompt_logprobs": 1}


def _scenarios() -> dict[str, list[tuple[list[int], dict]]]:
    """Each scenario's requests; the target is always the first."""
    target = [(TARGET, _greedy())]
    out = {"alone": target, "alone_again": target}
    for size in BATCHES:
        out[f"batch_{size}"] = target + [(_prompt(100 + i, len(TARGET)), _greedy()) for i in range(size - 1)]
    out["concurrent"] = target + [(_prompt(200 + i, 5 + 9 * i), _greedy(1 + i % 7)) for i in range(15)]
    out["score_alone"] = [(TARGET, SCORE)]
    out["score_loaded"] = [(TARGET, SCORE)] + [(_prompt(300 + i, 20 + 11 * i), _greedy(3)) for i in range(8)]
    return out


def _serve(runner: Any, chunked_prefill_size: int, requests: list[tuple[list[int], dict]]) -> dict:
    """The target's tokens and per-token logprobs (generated and, with echo, of the prompt)."""
    from arfusion.engine.common.sampling_params import SamplingParams
    from arfusion.engine.scheduling.scheduler import Scheduler
    from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
    from tests.fake_runner import serve_all

    scheduler = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=8192,
                          chunked_prefill_size=chunked_prefill_size)
    chunks = serve_all(scheduler, [(prompt, SamplingParams(**kw)) for prompt, kw in requests])[0]
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [t.logprob for c in chunks for t in c.logprobs or ()]
    prompt = [t.logprob for c in chunks for t in c.prompt_logprobs or ()]
    return {"tokens": tokens, "logprobs": logprobs, "prompt_logprobs": prompt}


def serve_scenarios(rank: int, world_size: int, backend: str = "torch", dtype: str = "auto",
                    model: str = "tiny") -> dict:
    """Collective: a deterministic runner of the built-in ``model`` (dummy weights) with fusion on
    (``backend``); rank 0 returns the target's results per scenario, the fusion op's counters and
    status."""
    from arfusion.engine.runtime.model_runner import ModelRunner, RunnerSettings
    from arfusion.engine.runtime.step_plan import StepPlan
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group
    from tests.plan_follower import follow_plans

    fusion = FusionConfig(enabled=True, backend=backend, deterministic=True)
    runner = ModelRunner(RunnerSettings(model_path=model, dtype=dtype, context_length=256, max_running_requests=40,
                                        kv_slots=8192, fusion=fusion), get_tp_group())
    try:
        if rank != 0:
            follow_plans(runner)
            return {}
        out = {name: _serve(runner, 64, requests) for name, requests in _scenarios().items()}
        out["score_whole"] = _serve(runner, 8192, [(TARGET, SCORE)])
        out["counts"] = {s.value: n for s, n in runner.fusion.counts.items()}
        out["status"] = runner.fusion.status()
        if world_size > 1:
            runner.group.broadcast_object(StepPlan("shutdown"))
        return out
    finally:
        runner.destroy()


def assert_generation_matches_alone(results: dict, scenario: str) -> None:
    """The target request's greedy tokens and logprob bits in ``scenario`` equal those it has alone."""
    alone, other = results["alone"], results[scenario]
    assert len(alone["tokens"]) == NEW_TOKENS and len(alone["logprobs"]) == NEW_TOKENS
    assert other["tokens"] == alone["tokens"]
    assert other["logprobs"] == alone["logprobs"], "bit-identical logprobs"


def assert_score_matches_alone(results: dict, scenario: str) -> None:
    """The target prompt's score bits in ``scenario`` equal those it has alone."""
    alone = results["score_alone"]["prompt_logprobs"]
    assert len(alone) == len(TARGET) - 1 and all(v <= 0 for v in alone)
    assert results[scenario]["prompt_logprobs"] == alone
