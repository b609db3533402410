"""benchmarks/kernels/bench_routing.py without a GPU: `select_steps_bound` puts a batch on the path
it names and restores the bound, also when the body raises; the command, and bench_align.py's,
refuses to run without CUDA, naming why. The kernel benchmarks' rows file (benchmarks/kernels/rows_file.py): JSON where a
path is given, nothing written without one."""
import sys

import pytest

pytest.importorskip("triton")

from arfusion.benchmarks.kernels import bench_routing  # noqa: E402
from arfusion.layers.moe.kernels import triton_router  # noqa: E402


def test_the_bound_picks_the_path_and_is_restored():
    kept = triton_router.ONE_LAUNCH_MAX_SELECT_STEPS
    assert not triton_router.takes_one_launch(128, 128, 8)
    with bench_routing.select_steps_bound(1 << 20):
        assert triton_router.takes_one_launch(128, 128, 8)
        assert not triton_router.takes_one_launch(257, 128, 8), "FUSED_MAX_SLOTS still bounds it"
    with pytest.raises(RuntimeError), bench_routing.select_steps_bound(0):
        assert not triton_router.takes_one_launch(1, 128, 8)
        raise RuntimeError
    assert triton_router.ONE_LAUNCH_MAX_SELECT_STEPS == kept


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_routing", "--tokens", "1"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_routing.main()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_align_bench_refuses_without_a_gpu(monkeypatch):
    from arfusion.benchmarks.kernels import bench_align

    monkeypatch.setattr(sys, "argv", ["bench_align", "--slots", "8"])
    with pytest.raises(SystemExit, match="bench_align needs a CUDA GPU"):
        bench_align.main()


def test_rows_are_written_as_json_only_where_a_path_is_given(tmp_path, monkeypatch):
    import json

    from arfusion.benchmarks.kernels.rows_file import write_rows

    path = tmp_path / "rows.json"
    path.write_text("old")
    write_rows(str(path), [{"tokens": 1, "us": 2.5}])
    assert json.loads(path.read_text()) == [{"tokens": 1, "us": 2.5}]
    monkeypatch.chdir(tmp_path)
    write_rows(None, [1])
    write_rows("", [1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]
