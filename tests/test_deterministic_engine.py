"""Batch invariance of the whole engine under ``deterministic`` on CPU: the tiny model (fp32), TP1
and TP2 over gloo with all-reduce fusion on (the torch fusion backend), through the scheduler
(tests/deterministic_scenarios.py has the scenarios). The target request's tokens and logprob
bits must be the same alone, in batches of 2, 8 and 32, among concurrent requests of other
lengths and in steps shared with another prompt's chunks (``mixed``; here the torch attention
gives decode and prompt rows the same bits anyway: tests/test_deterministic_mixed_steps.py runs
that case with the GPU's kernels); its prompt score's bits the same alone, under load, and in
chunks of 64 or whole. At
TP2 the layers' reductions must have run by a fused strategy, not NCCL (the fusion op's
counters). Each property compares bits: with the mode off, 9 of these cases fail on a 2-core
AVX-512 CPU with torch 2.13 (every batch and concurrent case but batch 2 at TP2, and both TP2
prompt-score cases), as torch's matmul gives a row other bits at other row counts. The same at
TP1 and TP2 for ``tiny-moe`` (the tiny model with Qwen3-MoE blocks, 8 experts top-2: the torch
routing and experts of layers/moe/); with that path's sums in torch's order (before its
batch-invariant mode) batch 8, batch 32 and concurrent fail at TP1."""
from __future__ import annotations

import functools

import pytest

from tests.deterministic_scenarios import (GENERATION, assert_generation_matches_alone, assert_score_matches_alone,
                                          serve_scenarios)
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.timeout(600)


RUNS = [(world_size, model) for model in ("tiny", "tiny-moe") for world_size in (1, 2)]


@functools.lru_cache(maxsize=None)
def results(world_size: int, model: str = "tiny") -> dict:
    return run_distributed(serve_scenarios, world_size=world_size, args=("torch", "auto", model), timeout_s=540)[0]


@pytest.mark.parametrize("world_size,model", RUNS)
@pytest.mark.parametrize("scenario", GENERATION)
def test_greedy_logprobs_are_bit_identical_whatever_the_batch(world_size: int, model: str, scenario: str):
    assert_generation_matches_alone(results(world_size, model), scenario)


@pytest.mark.parametrize("world_size,model", RUNS)
@pytest.mark.parametrize("scenario", ["score_loaded", "score_whole"])
def test_the_prompt_score_is_bit_identical_under_load_and_in_chunks(world_size: int, model: str, scenario: str):
    assert_score_matches_alone(results(world_size, model), scenario)


def test_tp2_reductions_ran_fused():
    r = results(2)
    assert r["status"]["active"], r["status"]["reason_inactive"]
    assert r["counts"].get("torch", 0) > 0 and r["counts"].get("nccl", 0) == 0, r["counts"]
