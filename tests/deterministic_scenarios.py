"""The scenarios of the engine-level batch-invariance tests (tests/test_deterministic_engine.py on
CPU, tests/gpu/test_deterministic_engine.py on the GPU): one target request (a fixed prompt,
greedy, a few tokens with their log-probabilities) alone, in batches of 2, 8 and 32 (the others:
random prompts of its length), among concurrent requests of other lengths (which join and leave
at other steps), beside a long prompt prefilled in chunks (``mixed``: each of the target's decode
steps also runs a chunk of that prompt, so its decode rows share the step's attention call with
prompt rows), and its prompt score (``echo``: the prompt's log-probabilities) alone, under
load, and prefilled in chunks of 64 tokens (the last chunk of 3: few rows, where a row-dependent
matmul changes bits) or whole (chunked prefill size 8192). `serve_scenarios` is the per-rank
worker: rank 0 runs the scenarios through the scheduler, the other ranks follow its plans.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

TARGET = torch.randint(0, 256, (67,), generator=torch.Generator().manual_seed(11)).tolist()
NEW_TOKENS = 4
BATCHES = (2, 8, 32)
MIXED_PROMPT = 250  # the long prompt of the "mixed" scenario (context 256)
GENERATION = ("alone_again", *(f"batch_{n}" for n in BATCHES), "concurrent", "mixed")  # vs "alone"


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
    # admitted after the target, in its second step: chunks of 61, 63, 63, 63 beside its decodes
    out["mixed"] = target + [(_prompt(400, MIXED_PROMPT), _greedy(2))]
    out["score_alone"] = [(TARGET, SCORE)]
    out["score_loaded"] = [(TARGET, SCORE)] + [(_prompt(300 + i, 20 + 11 * i), _greedy(3)) for i in range(8)]
    return out


def _serve(runner: Any, chunked_prefill_size: int, requests: list[tuple[list[int], dict]]) -> dict:
    """The target's tokens and per-token logprobs (generated and, with echo, of the prompt), and
    how many steps were mixed (decodes beside prompt chunks)."""
    from arfusion.engine.common.sampling_params import SamplingParams
    from arfusion.engine.scheduling.scheduler import Scheduler
    from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
    from tests.fake_runner import serve_all

    plans = []
    forward = runner.forward
    runner.forward = lambda plan: plans.append(plan) or forward(plan)
    try:
        scheduler = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=8192,
                              chunked_prefill_size=chunked_prefill_size)
        chunks = serve_all(scheduler, [(prompt, SamplingParams(**kw)) for prompt, kw in requests])[0]
    finally:
        del runner.forward
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [t.logprob for c in chunks for t in c.logprobs or ()]
    prompt = [t.logprob for c in chunks for t in c.prompt_logprobs or ()]
    mixed = sum(p.kind == "extend" and p.num_device_tokens > 0 for p in plans)
    return {"tokens": tokens, "logprobs": logprobs, "prompt_logprobs": prompt, "mixed_steps": mixed}


def serve_scenarios(rank: int, world_size: int, backend: str = "torch", dtype: str = "auto",
                    model: str = "tiny", names: Optional[Sequence[str]] = None) -> dict:
    """Collective: a deterministic runner of the built-in ``model`` (dummy weights) with fusion on
    (``backend``); rank 0 returns the target's results per scenario (``names``, with "alone" and
    "score_alone" always; None: every one), the fusion op's counters and status."""
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.runtime.step_plan import StepPlan
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group
    from tests.plan_follower import follow_plans

    fusion = FusionConfig(enabled=True, backend=backend, deterministic=True)
    runner = build_runner(RunnerSettings(model_path=model, dtype=dtype, context_length=256, max_running_requests=40,
                                        kv_slots=8192, fusion=fusion), get_tp_group())
    try:
        if rank != 0:
            follow_plans(runner)
            return {}
        chosen = None if names is None else {"alone", "score_alone", *names}
        out = {name: _serve(runner, 64, requests) for name, requests in _scenarios().items()
               if chosen is None or name in chosen}
        if chosen is None or "score_whole" in chosen:
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
    if scenario == "mixed":  # every decode step of the target (its tokens after the first) was a mixed step
        assert alone["mixed_steps"] == 0 and other["mixed_steps"] >= NEW_TOKENS - 1, other["mixed_steps"]


def assert_score_matches_alone(results: dict, scenario: str) -> None:
    """The target prompt's score bits in ``scenario`` equal those it has alone."""
    alone = results["score_alone"]["prompt_logprobs"]
    assert len(alone) == len(TARGET) - 1 and all(v <= 0 for v in alone)
    assert results[scenario]["prompt_logprobs"] == alone
