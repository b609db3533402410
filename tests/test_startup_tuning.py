"""Start-up tuning over gloo (2 ranks; flashinfer and an sm90 GPU pretended, a fake workspace):
a configuration no table holds is measured at set-up, every rank gets rank 0's table, rank 0
caches it, the next set-up reads the cache instead of measuring, and the switches work (off,
an explicit table, a passed budget). On the CPU nccl (gloo) measures; the symmetric-memory
backends cannot make their buffers there (voted: on no rank) and flashinfer two-shot fails and is
left out on every rank, as on a GPU where one fails; flashinfer one-shot is played by the torch
reference, which checks that it gets the op's workspace."""
import pytest
import torch

from arfusion.fusion.tuning.startup import cache_file
from tests.dist_utils import make_fusion, run_distributed

HIDDEN = 64


class _FakeWorkspace:
    def destroy(self) -> None:
        pass


def _pretend_flashinfer() -> None:
    import arfusion.fusion.backends.flashinfer as fi
    import arfusion.fusion.backends.flashinfer_workspace as ws

    fi.flashinfer_unavailable_reason = lambda *a: None
    ws.create_flashinfer_workspace = lambda *a: _FakeWorkspace()
    ws._preflight = lambda *a: None


def _op(cache_dir, **config):
    return make_fusion(HIDDEN, torch.float32, enabled=True, backend="flashinfer", max_tokens=16, symm_max_tokens=16,
                       tuning_cache_dir=cache_dir, **config)


def _pretend_flashinfer_kernel() -> None:
    """flashinfer one-shot as the torch reference, refusing to run without the op's workspace;
    two-shot fails."""
    import arfusion.fusion.backends.flashinfer as fi
    from arfusion.fusion import reference
    from arfusion.fusion.strategy import FusedOutput
    from arfusion.layers.parallel_state import get_tp_group

    def kernel(workspace, x, residual, weight, eps, quant, one_shot, launch_with_pdl):
        assert isinstance(workspace, _FakeWorkspace), f"one-shot ran with workspace {workspace!r}"
        if not one_shot:
            raise RuntimeError("two-shot is not played on the CPU")
        get_tp_group().all_reduce(x)
        return FusedOutput(*reference.add_rms_norm(x, residual, weight, eps))

    fi.run_trtllm_fusion = kernel


def _tune_then_reuse(rank, world_size, cache_dir):
    import arfusion.fusion.tuning.measure as tune

    _pretend_flashinfer()
    _pretend_flashinfer_kernel()
    first = _op(cache_dir)
    table = first.table
    out = {"buckets": table.buckets,
           "measured": sorted({s for row in table.timings_us for s in row}),
           "reductions_after_setup": dict(first.counts),
           "cached": cache_file(first.group, HIDDEN, torch.float32, cache_dir).exists()}
    first.destroy()

    def no_measurement(*args, **kwargs):
        raise AssertionError("the cached table must be used")

    tune.measure_bucket = no_measurement
    second = _op(cache_dir)
    out["reused"] = second.table == table
    second.destroy()
    out["off"] = _op(cache_dir + "-off", tune_at_startup=False).table
    return out


def test_a_configuration_without_a_table_is_measured_once_and_cached(tmp_path):
    r0, r1 = run_distributed(_tune_then_reuse, args=(str(tmp_path / "cache"),), timeout_s=120)
    assert r0["buckets"] == r1["buckets"] == (1, 2, 4, 8, 16)
    assert r0["measured"] == r1["measured"] == ["flashinfer_one_shot", "nccl"], "one-shot ran with the workspace"
    assert r0["reductions_after_setup"] == {}, "tuning's runs are not counted as the model's reductions"
    assert r0["cached"] and r0["reused"] and r1["reused"]
    assert r0["off"] is None and r1["off"] is None, "--disable-allreduce-fusion-tuning: the built-in rule"
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1


def _budget_and_explicit_table(rank, world_size, cache_dir, table_path):
    _pretend_flashinfer()
    passed = _op(cache_dir, tuning_budget_s=1e-6).table
    explicit = _op(cache_dir, table_path=table_path).table
    return passed, explicit


def test_a_passed_budget_or_an_explicit_table_means_no_tuned_table(tmp_path, caplog):
    missing = str(tmp_path / "no-such-table.json")
    results = run_distributed(_budget_and_explicit_table, args=(str(tmp_path / "cache"), missing), timeout_s=120)
    assert results == [(None, None), (None, None)]
    assert not (tmp_path / "cache").exists(), "an abandoned measurement caches nothing"


@pytest.mark.parametrize("gpu_dir", ["a/b", "x y"])
def test_cache_file_names_are_safe(tmp_path, gpu_dir):
    from arfusion.fusion import TensorParallelGroup

    group = TensorParallelGroup(0, 1, torch.device("cpu"))
    path = cache_file(group, 4096, torch.bfloat16, str(tmp_path / gpu_dir))
    assert path.name == "cpu_tp1_h4096_bfloat16.json" and path.parent.parent == tmp_path / gpu_dir
