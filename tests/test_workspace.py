"""Workspace lifecycle: votes over the CPU group, failure on one rank, growth, destroy."""
import pytest
import torch

from arfusion.fusion import AllReduceFusionWorkspace, PartialSum
from arfusion.layers.parallel_state import get_tp_group
from tests.dist_utils import make_fusion, run_distributed
from tests.tolerances import assert_close


class FakeHandle:
    destroyed: list = []

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    def destroy(self) -> None:
        FakeHandle.destroyed.append(self.max_tokens)


def fail_on_rank(bad_rank: int):
    def factory(group, max_tokens, hidden, dtype):
        if group.rank == bad_rank:
            raise RuntimeError("injected allocation failure")
        return FakeHandle(max_tokens)
    return factory


def _lifecycle(rank, world_size):
    group = get_tp_group()
    ws = AllReduceFusionWorkspace(group, fail_on_rank(bad_rank=-1))
    assert ws.ensure(64, 128, torch.bfloat16)
    assert ws.fits(64, 128, torch.bfloat16) and not ws.fits(65, 128, torch.bfloat16)
    assert ws.ensure(32, 128, torch.bfloat16) and ws.shape.max_tokens == 64, "never shrinks"
    assert ws.ensure(256, 128, torch.bfloat16) and ws.shape.max_tokens == 256, "grows"
    assert FakeHandle.destroyed == [64], "the old workspace is destroyed when it grows"
    ws.destroy()
    ws.destroy()
    assert FakeHandle.destroyed == [64, 256] and not ws.ready
    return True


def test_workspace_grows_never_shrinks_and_destroys_once():
    assert run_distributed(_lifecycle) == [True, True]


def _one_rank_fails(rank, world_size):
    group = get_tp_group()
    ws = AllReduceFusionWorkspace(group, fail_on_rank(bad_rank=1))
    ok = ws.ensure(64, 128, torch.bfloat16)
    return ok, ws.ready, ws.failure


def test_failure_on_one_rank_makes_all_fall_back_without_hang():
    results = run_distributed(_one_rank_fails, timeout_s=60)
    for ok, ready, failure in results:
        assert ok is False and ready is False
        assert "rank 1" in failure and "injected allocation failure" in failure


def _fusion_falls_back_together(rank, world_size):
    import arfusion.fusion.backends.flashinfer as fi
    import arfusion.fusion.backends.flashinfer_workspace as ws

    # Pretend this CPU rank had flashinfer and an sm90 GPU, so setup reaches the workspace.
    fi.flashinfer_unavailable_reason = lambda *a: None
    ws.create_flashinfer_workspace = fail_on_rank(0)
    ws._preflight = lambda *a: None
    fusion = make_fusion(64, torch.float32, enabled=True, backend="flashinfer")
    reason = fusion.status()["reason_inactive"]
    assert not fusion.active and "flashinfer_one_shot unavailable" in reason and "rank 0" in reason
    assert not fusion.should_fuse_allreduce_residual_rmsnorm(0, 4)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank)) + 1
    residual = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    weight = torch.rand(64, generator=torch.Generator().manual_seed(10)) + 0.5
    expected_sum = sum(torch.randn(4, 64, generator=torch.Generator().manual_seed(r)) + 1 for r in range(world_size))
    partial = PartialSum(pending=x, layer_id=0, op=fusion)
    normed, res = fusion.reduce_add_rms_norm(partial, residual.clone(), weight, 1e-6)
    assert_close(res, expected_sum + residual)
    assert fusion.counts == {"nccl": 1}
    return fusion.status()["reason_inactive"]


def test_fusion_setup_failure_falls_back_on_every_rank():
    reasons = run_distributed(_fusion_falls_back_together, timeout_s=60)
    assert reasons[0] == reasons[1]


@pytest.mark.parametrize("sm,spans,hidden,needle", [
    (None, False, 128, "needs an sm90/sm100 GPU"), ((8, 0), False, 128, "sm80"), ((12, 0), False, 128, "sm120"),
    ((9, 0), True, 128, "spans nodes"), ((9, 0), False, 100, "multiple of 16"), ((9, 0), False, 128, None)])
def test_the_flashinfer_backends_state_their_constraints(monkeypatch, sm, spans, hidden, needle):
    import arfusion.fusion.backends.flashinfer as fi
    from arfusion.fusion import TensorParallelGroup

    monkeypatch.setattr(fi, "flashinfer_import_error", lambda: None)
    monkeypatch.setattr(fi, "device_capability", lambda device: sm)
    group = TensorParallelGroup(0, 1, torch.device("cpu"), node_ids=[0])
    if spans:
        group.node_ids = [0, 1]
    reason = fi.flashinfer_unavailable_reason(group, hidden, torch.bfloat16)
    assert reason is None if needle is None else needle in reason
