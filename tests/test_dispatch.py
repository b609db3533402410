"""The cached fusion decision: what the backends fit, LRU bound and order, counters, rank agreement."""
import pytest
import torch

from arfusion.fusion.dispatch.decision import NOT_SET_UP, DispatchPlan
from arfusion.fusion.strategy import Strategy as S
from tests.dist_utils import make_fusion, run_distributed
from tests.fake_backends import UNLIMITED, FakeBackend, flashinfer_backends, make_dispatcher


def test_a_dispatcher_not_set_up_never_fuses():
    d = DispatchPlan(cache_size=64)
    assert d.should_fuse_allreduce_residual_rmsnorm(0, 1) is False
    assert d.why_not(0, 1) == NOT_SET_UP
    info = d.cache_info()
    assert (info.hits, info.misses, info.maxsize, info.currsize) == (0, 1, 64, 1)


def test_backends_that_fit_fuse():
    d = make_dispatcher(flashinfer_backends())
    assert d.should_fuse_allreduce_residual_rmsnorm(3, 128)
    assert d.strategy(3, 128) is S.FLASHINFER_ONE_SHOT
    assert d.why_not(3, 128) is None


@pytest.mark.parametrize(
    "backends,off_reason,batch,needle",
    [
        (flashinfer_backends(), "fusion is not enabled", 1, "not enabled"),
        ({S.NCCL: FakeBackend(UNLIMITED)}, None, 1, "no fused strategy can take 1 tokens"),
        (flashinfer_backends(max_tokens=0), None, 1, "no fused strategy"),
        (flashinfer_backends(), None, 2049, "no fused strategy can take 2049 tokens"),
        (flashinfer_backends(), None, 0, "empty batch"),
    ],
)
def test_each_condition_turns_fusion_off_with_a_reason(backends, off_reason, batch, needle):
    d = make_dispatcher(backends, off_reason=off_reason)
    assert d.should_fuse_allreduce_residual_rmsnorm(0, batch) is False
    assert needle in d.why_not(0, batch)


def test_two_shot_is_never_chosen_for_as_many_tokens_as_ranks():
    backends = {S.NCCL: FakeBackend(UNLIMITED), S.FLASHINFER_TWO_SHOT: FakeBackend(4096, more_than=4)}
    d = make_dispatcher(backends, world_size=4)  # no cost model at TP4: flashinfer's kernels by size
    assert d.strategy(0, 4) is S.NCCL and d.strategy(0, 5) is S.FLASHINFER_TWO_SHOT


def test_torch_backend_fuses_up_to_its_limit():
    d = make_dispatcher({S.NCCL: FakeBackend(UNLIMITED), S.TORCH: FakeBackend(64)}, hidden=100)
    assert d.strategy(0, 64) is S.TORCH
    assert not d.should_fuse_allreduce_residual_rmsnorm(0, 65)


def test_negative_layer_id_is_an_error():
    with pytest.raises(ValueError, match="layer_id"):
        make_dispatcher(flashinfer_backends()).should_fuse_allreduce_residual_rmsnorm(-1, 4)


def test_cache_size_must_be_positive():
    from arfusion.fusion import FusionConfig

    with pytest.raises(ValueError, match="cache_size"):
        FusionConfig(cache_size=0)


def test_hits_misses_and_false_answers_are_cached():
    d = make_dispatcher(flashinfer_backends(), cache_size=8)
    d.should_fuse_allreduce_residual_rmsnorm(0, 1)
    d.should_fuse_allreduce_residual_rmsnorm(0, 1)
    d.should_fuse_allreduce_residual_rmsnorm(0, 5000)  # False answer
    d.should_fuse_allreduce_residual_rmsnorm(0, 5000)
    info = d.cache_info()
    assert (info.hits, info.misses, info.currsize) == (2, 2, 2)


def test_bound_holds_over_thousands_of_batch_sizes_and_lru_goes_first():
    d = make_dispatcher(flashinfer_backends(), cache_size=16)
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


def test_a_new_plan_has_a_new_cache_and_the_backends_answer_anew():
    backends = flashinfer_backends()
    d = make_dispatcher(backends)
    assert d.should_fuse_allreduce_residual_rmsnorm(0, 8)
    backends[S.FLASHINFER_ONE_SHOT].capacity = 0  # the workspace was destroyed
    backends[S.FLASHINFER_TWO_SHOT].capacity = 0
    d = make_dispatcher(backends)
    assert d.cache_info().currsize == 0
    assert not d.should_fuse_allreduce_residual_rmsnorm(0, 8)


def _events_replace_the_plan(rank, world_size):
    fusion = make_fusion(96, enabled=True, backend="torch", max_tokens=16)
    answers = [fusion.should_fuse_allreduce_residual_rmsnorm(0, 8)]
    fusion.backends[S.TORCH].destroy()  # an event no one tells the op about: the backend does
    answers.append(fusion.should_fuse_allreduce_residual_rmsnorm(0, 8))
    fusion.backends[S.TORCH].ensure(16, 96, torch.float32)
    answers.append(fusion.should_fuse_allreduce_residual_rmsnorm(0, 8))
    return answers


def test_every_resource_event_replaces_the_plan():
    assert run_distributed(_events_replace_the_plan) == [[True, False, True]] * 2


def _decisions(rank, world_size):
    fusion = make_fusion(96, enabled=True, backend="torch", max_tokens=300, cache_size=32)
    return [fusion.should_fuse_allreduce_residual_rmsnorm(layer, bs) for layer in range(3) for bs in range(1, 400, 7)]


def test_decision_agrees_on_both_ranks():
    r0, r1 = run_distributed(_decisions)
    assert r0 == r1
    assert any(r0) and not all(r0)


def test_the_hot_path_answers_are_the_cached_strategies():
    d = make_dispatcher(flashinfer_backends(symm_mem_fused=UNLIMITED), dtype=torch.float16)
    for tokens in (1, 64, 4096, 100000):
        assert d.should_fuse_allreduce_residual_rmsnorm(1, tokens) == (d.strategy(1, tokens) is not S.NCCL)
