"""Deterministic mode's mixed steps with the GPU's attention kernels, on CPU: the engine of
tests/test_deterministic_engine.py (the tiny model in fp32, TP1 and TP2 over gloo, fusion on,
through the scheduler), but its attention run by the Triton decode and extend kernels under
Triton's CPU interpreter (the torch path gives a prompt row and a decode row the same bits, so
only these kernels can tell how a mixed step's decode rows were attended). The target request's
tokens and logprob bits must be the same alone, beside a long prompt prefilled in chunks (each of
its decode steps a mixed step) and in a batch of 8. Taking a mixed step's decode rows through the
extend kernel with its prompt rows fails the mixed case: the two kernels add in different orders.
"""
from __future__ import annotations

import functools

import pytest

from tests.deterministic_scenarios import assert_generation_matches_alone, serve_scenarios
from tests.dist_utils import run_under_triton_interpreter

pytest.importorskip("triton")

pytestmark = pytest.mark.timeout(900)  # the interpreter: about 5 minutes per TP size on 2 busy cores
SCENARIOS = ("mixed", "batch_8")


def serve_by_triton_kernels(rank: int, world_size: int) -> dict:
    """Collective: `serve_scenarios` (``SCENARIOS``) with `layers.attention.Attention` taking its
    Triton path on CPU tensors too (this process runs under the interpreter)."""
    from arfusion.layers.attention import Attention

    Attention.uses_triton = lambda self, q: True  # the tiny model's fp32 and head dim 32 suit the kernels
    return serve_scenarios(rank, world_size, names=SCENARIOS)


@functools.lru_cache(maxsize=None)
def results(world_size: int) -> dict:
    out = run_under_triton_interpreter(serve_by_triton_kernels, timeout_s=840, world_size=world_size)
    return out if world_size == 1 else out[0]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_logprobs_are_bit_identical_in_mixed_steps_with_the_gpu_kernels(world_size: int, scenario: str):
    assert_generation_matches_alone(results(world_size), scenario)
