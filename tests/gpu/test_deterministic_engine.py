"""Batch invariance of the whole engine under ``deterministic`` on the GPU: the tiny model in
bf16 with CUDA graphs (TP1), and at TP2 (two GPUs, or two ranks sharing one) with flashinfer's
all-reduce fusion on; the scenarios of tests/deterministic_scenarios.py. The target request's
tokens and logprob bits must be the same alone, in batches of 2, 8 and 32, among concurrent
requests of other lengths and in steps shared with another prompt's chunks (``mixed``: its decode
rows run eagerly in the decode kernel beside the extend kernel's prompt rows, alone they replay a
CUDA graph); its prompt score's bits the same alone, under load, and in chunks of 64 or whole. At
TP2 every reduction must have run by a fused strategy, none by NCCL. The same scenarios at TP1 for
a MoE model (the Triton routing and fused MoE in their batch-invariant tiles): ``tiny-moe``
(Qwen3-MoE blocks, 8 experts top-2), or the built-in model that ``ARFUSION_MOE_MODEL`` names
(``qwen3-30b-a3b``: 48 layers of 128 experts top-8, dummy weights, about 61 GB; ``mixtral-8x7b``)."""
import functools
import os

import pytest

from tests.deterministic_scenarios import (GENERATION, assert_generation_matches_alone, assert_score_matches_alone,
                                          serve_scenarios)
from tests.dist_utils import gpu_world_size, run_distributed

pytestmark = pytest.mark.timeout(900)
MOE_MODEL = os.environ.get("ARFUSION_MOE_MODEL", "tiny-moe")
RUNS = [pytest.param(1, "tiny", marks=pytest.mark.gpus(1)),
        pytest.param(gpu_world_size(), "tiny", marks=pytest.mark.tp_ranks(gpu_world_size())),
        pytest.param(1, MOE_MODEL, marks=pytest.mark.gpus(1))]


@functools.lru_cache(maxsize=None)
def results(world_size: int, model: str = "tiny") -> dict:
    return run_distributed(serve_scenarios, world_size=world_size, args=("flashinfer", "bfloat16", model),
                           device_kind="cuda", timeout_s=800)[0]


@pytest.mark.parametrize("world_size,model", RUNS)
@pytest.mark.parametrize("scenario", GENERATION)
def test_greedy_logprobs_are_bit_identical_whatever_the_batch(world_size: int, model: str, scenario: str):
    assert_generation_matches_alone(results(world_size, model), scenario)


@pytest.mark.parametrize("world_size,model", RUNS)
@pytest.mark.parametrize("scenario", ["score_loaded", "score_whole"])
def test_the_prompt_score_is_bit_identical_under_load_and_in_chunks(world_size: int, model: str, scenario: str):
    assert_score_matches_alone(results(world_size, model), scenario)


@pytest.mark.tp_ranks(gpu_world_size())
def test_tp_reductions_ran_fused():
    r = results(gpu_world_size())
    assert r["status"]["active"], r["status"]["reason_inactive"]
    assert r["counts"].get("nccl", 0) == 0 and sum(r["counts"].values()) > 0, r["counts"]
