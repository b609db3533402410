"""TP ranks sharing one GPU (CPU-testable parts): detection from the device identities the ranks
exchange, the launcher's device choice, no tuning there, and the benchmarks' "shared GPU" marks.
The collectives of this mode run in tests/gpu (`run.sh tests` on one GPU)."""
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from arfusion.fusion.group import TensorParallelGroup

H200 = "cuda:0 (NVIDIA H200)"


def group_of(rank: int, devices: list, nodes: list | None = None) -> TensorParallelGroup:
    world = len(devices)
    nodes = nodes or [("host", 0)] * world
    ids = [None if d is None else (f"GPU-{d}", f"cuda:{d} (NVIDIA H200)") for d in devices]
    pg = object()  # never used: only the identities are read
    return TensorParallelGroup(rank, world, torch.device("cpu"), pg if world > 1 else None, pg if world > 1 else None,
                               nodes, ids)


@pytest.mark.parametrize("devices, nodes, shared", [
    ([0, 1], None, {}),
    ([0, 0], None, {H200: [0, 1]}),
    ([0, 1, 0, 1], None, {H200: [0, 2], "cuda:1 (NVIDIA H200)": [1, 3]}),
    ([0, 0], [("a", 0), ("b", 1)], {}),  # the same GPU index (and UUID) on two nodes is two GPUs
    ([None, None], None, {}),  # CPU ranks
])
def test_ranks_sharing_a_gpu_are_found_from_their_identities(devices, nodes, shared):
    group = group_of(0, devices, nodes)
    assert group.shared_gpus == shared
    assert group.shares_gpu == bool(shared)
    assert (group.shared_gpu_note is None) == (not shared)


def test_the_note_names_the_ranks_and_the_gpu_and_says_timings_mean_nothing():
    note = group_of(1, [0, 0]).shared_gpu_note
    assert "ranks 0, 1 share cuda:0 (NVIDIA H200)" in note and "not representative" in note


@pytest.mark.parametrize("devices, rank, expected", [([0, 0], 1, 2), ([0, 1, 0], 1, 1), ([0, 1, 0], 2, 2),
                                                     ([None, None], 0, 1)])
def test_ranks_on_this_gpu_split_its_memory(devices, rank, expected):
    assert group_of(rank, devices).ranks_on_this_gpu == expected


def test_more_ranks_than_gpus_run_on_the_gpus_there_are(monkeypatch):
    from arfusion.engine import launch_config as lc
    from arfusion.layers import parallel_state
    from arfusion.server_args import ServerArgs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    launch = lc.launch_config(ServerArgs(tp_size=2, device="cuda"))  # refused before: "needs 2 GPUs per node"
    assert [launch.device_for(r) for r in launch.local_ranks] == [torch.device("cuda", 0)] * 2
    assert parallel_state.default_device(3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [parallel_state.default_device(r) for r in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]


def test_start_up_tuning_measures_nothing_on_a_shared_gpu(tmp_path, monkeypatch, caplog):
    import arfusion.fusion.tuning.startup as startup

    def no_measurement(*args, **kwargs):
        raise AssertionError("nothing may be measured on a shared GPU")

    monkeypatch.setattr(startup, "table_entry", no_measurement)
    group = group_of(0, [0, 0])
    monkeypatch.setattr(startup, "gpu_name", lambda device: "NVIDIA H200")
    with caplog.at_level("WARNING"):
        assert startup.tune_at_startup(group, {}, [], 4096, torch.bfloat16, 64, str(tmp_path), budget_s=20.0) is None
    assert "share a GPU" in caplog.text and "built-in rule decides" in caplog.text
    assert not any(tmp_path.rglob("*.json")), "nothing is cached"


def test_bench_one_batch_marks_every_shared_gpu_row(capsys):
    from arfusion.engine.bench_one_batch import report

    note = group_of(0, [0, 0]).shared_gpu_note
    rows = [{"fusion": s, "batch_size": 1, "prefill_ms": 2.0, "tpot_ms": t, "floor_ms": 0.5, "fusion_active": s == "on",
             "fusion_reason_inactive": None, "shared_gpu": note} for s, t in (("off", 1.0), ("on", 0.9))]
    server = SimpleNamespace(model_path="tiny", tp_size=2, disable_overlap_schedule=False, norm_into_qkv=False,
                             norm_into_route=False, disable_combine_into_norm=False, rotary_into_attention=False,
                             prefetch_o_proj=False,
                             prefetch_o_proj_max_batch=1, enable_pdl=False, pdl_max_batch=1)
    report(server, Namespace(fusion=["off", "on"], deterministic_modes=["off"], batch_size=[1], input_len=4, output_len=2,
                             json_file=None), rows)
    out = capsys.readouterr().out
    assert out.startswith("NOT REPRESENTATIVE") and note in out
    assert out.splitlines()[-1].endswith("shared GPU")


def test_kernel_benchmark_marks_every_shared_gpu_row():
    from arfusion.benchmarks.kernels.fused_collective_report import ConfigResult, PathResult, format_markdown, format_table

    cfg = ConfigResult(1, 4096, "bfloat16", True, "none", [PathResult("standard_allreduce_rmsnorm", 0.01),
                                                           PathResult("arfusion_dispatch", 0.004)], shared_gpu=True)
    rows = [line for line in format_table(cfg).splitlines() if line.startswith(("standard", "arfusion"))]
    assert len(rows) == 2 and all("(shared GPU)" in line for line in rows)
    assert format_markdown(cfg).count("(shared GPU)") == 2
