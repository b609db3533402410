"""benchmarks/kernels/bench_routing.py without a GPU: the default path of each batch (one launch at
one token, two beyond; FUSED_MAX_SLOTS bounds the one-launch path), and `route_triton`'s refusal of
a one-launch path asked for beyond FUSED_MAX_SLOTS, naming it; the benchmark's routing groups the
slots by the grouping launch only where the routing left them ungrouped and a block size is given
(``--ungrouped``: none); the command, and bench_align.py's, refuses to run without CUDA, naming why. The kernel benchmarks' rows file (benchmarks/kernels/rows_file.py): JSON where a
path is given, nothing written without one."""
import sys

import pytest

pytest.importorskip("triton")

from arfusion.benchmarks.kernels import bench_routing  # noqa: E402
from arfusion.layers.moe.kernels import triton_router  # noqa: E402


def test_one_launch_by_default_at_one_token_grouped_and_up_to_four_ungrouped():
    assert triton_router.takes_one_launch(1, 8)
    assert not triton_router.takes_one_launch(2, 8)
    assert triton_router.takes_one_launch(4, 8, grouped=False)
    assert not triton_router.takes_one_launch(5, 8, grouped=False)
    assert not triton_router.takes_one_launch(1, triton_router.FUSED_MAX_SLOTS + 1), "FUSED_MAX_SLOTS bounds it"
    assert not triton_router.takes_one_launch(1, triton_router.FUSED_MAX_SLOTS + 1, grouped=False)


def test_a_one_launch_path_asked_for_beyond_its_slots_is_refused():
    import torch

    tokens = triton_router.FUSED_MAX_SLOTS // 8 + 1
    h, gate = torch.randn(tokens, 32), torch.randn(16, 32)
    counter = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"at most {triton_router.FUSED_MAX_SLOTS} slots .* got {tokens} x 8"):
        triton_router.route_triton(h, gate, 8, True, counter, one_launch=True)


@pytest.mark.parametrize("one_launch,block_m,grouped", [(True, 16, False), (False, 16, True), (False, None, False)])
def test_the_grouping_launch_runs_only_where_the_routing_left_it(monkeypatch, one_launch, block_m, grouped):
    from arfusion.layers.moe.kernels import triton_align

    launched = []
    monkeypatch.setattr(triton_router, "route_triton", lambda h, gate, k, renorm, counter, m, bias, one_launch: (
        None, "ids", "blocks" if one_launch and m is not None else None))
    monkeypatch.setattr(triton_align, "align_by_expert_triton", lambda ids, experts, m: launched.append((ids, m)))
    gate = __import__("torch").empty(8, 4)
    bench_routing.route_and_group(None, gate, None, 2, block_m, None, one_launch)
    assert launched == ([("ids", block_m)] if grouped else [])


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
