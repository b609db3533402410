"""The cached fusion decision: conditions, LRU bound and order, counters, rank agreement."""
import pytest
import torch

from fusion import FusionDispatcher, FusionEnvironment
from tests.dist_utils import make_fusion, run_distributed

GOOD = FusionEnvironment(
    enabled=True, backend="flashinfer", world_size=2, hidden_size=4096, dtype=torch.bfloat16,
    max_tokens=2048, device_sm=(9, 0), workspace_ready=True,
)


def test_constructs_with_defaults_on_cpu_without_process_group():
    d = FusionDispatcher(cache_size=64)
    assert d.should_fuse_allreduce_residual_rmsnorm(0, 1) is False
    assert "not enabled" in d.why_not(0, 1)
    info = d.cache_info()
    assert (info.hits, info.misses, info.maxsize, info.currsize) == (0, 1, 64, 1)


def test_good_environment_fuses():
    d = FusionDispatcher(environment=GOOD)
    assert d.should_fuse_allreduce_residual_rmsnorm(3, 128)
    assert d.why_not(3, 128) is None


@pytest.mark.parametrize(
    "change,batch,needle",
    [
        ({"enabled": False}, 1, "not enabled"),
        ({"world_size": 1}, 1, "TP size is 1"),
        ({"flashinfer_error": "flashinfer is not importable"}, 1, "flashinfer"),
        ({"device_sm": None}, 1, "no CUDA device"),
        ({"device_sm": (8, 0)}, 1, "sm80"),
        ({"device_sm": (12, 0)}, 1, "sm120"),
        ({"spans_nodes": True}, 1, "spans nodes"),
        ({"hidden_size": 4100}, 1, "multiple of 16"),
        ({"workspace_ready": False}, 1, "no fusion workspace"),
        ({}, 2049, "exceed the fusion limit"),
        ({}, 0, "empty batch"),
        ({"world_size": 4, "symm_fused_tokens": 64}, 2049, "exceed the fusion limit"),
    ],
)
def test_each_condition_turns_fusion_off_with_a_reason(change, batch, needle):
    env = FusionEnvironment(**{**GOOD.__dict__, **change})
    d = FusionDispatcher(environment=env)
    assert d.should_fuse_allreduce_residual_rmsnorm(0, batch) is False
    assert needle in d.why_not(0, batch)


def test_torch_backend_needs_no_gpu_or_workspace():
    env = FusionEnvironment(enabled=True, backend="torch", world_size=2, hidden_size=100, max_tokens=64)
    d = FusionDispatcher(environment=env)
    assert d.should_fuse_allreduce_residual_rmsnorm(0, 64)
    assert not d.should_fuse_allreduce_residual_rmsnorm(0, 65)


def test_negative_layer_id_is_an_error():
    with pytest.raises(ValueError, match="layer_id"):
        FusionDispatcher(environment=GOOD).should_fuse_allreduce_residual_rmsnorm(-1, 4)


def test_cache_size_must_be_positive():
    with pytest.raises(ValueError, match="cache_size"):
        FusionDispatcher(cache_size=0)


def test_hits_misses_and_false_answers_are_cached():
    d = FusionDispatcher(cache_size=8, environment=GOOD)
    d.should_fuse_allreduce_residual_rmsnorm(0, 1)
    d.should_fuse_allreduce_residual_rmsnorm(0, 1)
    d.should_fuse_allreduce_residual_rmsnorm(0, 5000)  # False answer
    d.should_fuse_allreduce_residual_rmsnorm(0, 5000)
    info = d.cache_info()
    assert (info.hits, info.misses, info.currsize) == (2, 2, 2)


def test_bound_holds_over_thousands_of_batch_sizes_and_lru_goes_first():
    d = FusionDispatcher(cache_size=16, environment=GOOD)
    for bs in range(1, 3001):
        d.should_fuse_allreduce_residual_rmsnorm(0, bs)
    assert d.cache_info().currsize == 16
    # The 16 most recent keys are cached; touch the oldest of them, then add one new key:
    d.should_fuse_allreduce_residual_rmsnorm(0, 2985)  # hit: becomes most recent
    d.should_fuse_allreduce_residual_rmsnorm(0, 5)  # miss: evicts the least recent, 2986
    hits = d.cache_info().hits
    d.should_fuse_allreduce_residual_rmsnorm(0, 2985)
    assert d.cache_info().hits == hits + 1, "recently used entry must survive"
    misses = d.cache_info().misses
    d.should_fuse_allreduce_residual_rmsnorm(0, 2986)
    assert d.cache_info().misses == misses + 1, "least recently used entry must be gone"


def test_environment_update_clears_cache():
    d = FusionDispatcher(environment=GOOD)
    assert d.should_fuse_allreduce_residual_rmsnorm(0, 8)
    d.update_environment(FusionEnvironment(**{**GOOD.__dict__, "workspace_ready": False}))
    assert d.cache_info().currsize == 0
    assert not d.should_fuse_allreduce_residual_rmsnorm(0, 8)


def _decisions(rank, world_size):
    fusion = make_fusion(96, enabled=True, backend="torch", max_tokens=300, cache_size=32)
    return [fusion.should_fuse_allreduce_residual_rmsnorm(layer, bs) for layer in range(3) for bs in range(1, 400, 7)]


def test_decision_agrees_on_both_ranks():
    r0, r1 = run_distributed(_decisions)
    assert r0 == r1
    assert any(r0) and not all(r0)
