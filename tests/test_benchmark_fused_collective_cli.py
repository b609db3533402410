"""benchmark_fused_collective without a GPU: the launch check, the argument parser, the
baseline choice and the table / Markdown / JSON output, and the plot script's data."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arfusion.benchmarks.kernels import benchmark_fused_collective as bench
from arfusion.benchmarks.kernels.fused_collective_report import (
    ConfigResult,
    PathResult,
    choose_baseline,
    config_header,
    format_markdown,
    format_table,
    json_document,
    overhead_vs_raw,
)
from arfusion.benchmarks.kernels.plot_fused_collective import speedup_series

SCRIPT = Path(bench.__file__)


def config(times: dict[str, float | None], errors: dict[str, str] | None = None, **fields) -> ConfigResult:
    """A configuration whose paths took ``times`` (None: failed with ``errors[name]``)."""
    errors = errors or {}
    paths = [
        PathResult(name, time_ms=t, time_ms_per_rank=[] if t is None else [t * 0.99, t], error=errors.get(name))
        for name, t in times.items()
    ]
    base = dict(seq_len=128, hidden_dim=4096, dtype="bfloat16", residual=True, quant_mode="none")
    base.update(fields)
    return ConfigResult(paths=paths, **base)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [None, "1"])
def test_script_refuses_to_run_outside_a_multi_gpu_torchrun(tmp_path, world_size):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTHONPATH")}
    if world_size is not None:
        env["WORLD_SIZE"] = world_size
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--seq-lens", "4"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "torchrun" in proc.stderr and "at least 2 GPUs" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "environ, ok",
    [({}, False), ({"WORLD_SIZE": "1"}, False), ({"WORLD_SIZE": "two"}, False), ({"WORLD_SIZE": "2"}, True),
     ({"WORLD_SIZE": "8"}, True)],
)
def test_launch_error(environ, ok):
    error = bench.launch_error(environ)
    assert (error is None) == ok
    if not ok:
        assert "torchrun" in error


def test_parser_defaults():
    args = bench.build_parser().parse_args([])
    assert args.seq_lens == [128, 512, 1024, 2048]
    assert args.hidden_dim == [8192]
    assert args.dtypes == ["bfloat16"]
    assert (args.warmup, args.trials, args.ops_per_graph) == (5, 20, 20)
    assert not args.disable_oneshot
    assert args.output_file is None and args.json_file is None
    assert bench.quant_modes(args) == ["none", "fp8", "fp4"]
    assert bench.residual_modes(args) == [True, False]


@pytest.mark.parametrize(
    "flag, modes",
    [("--no-quant", ["none"]), ("--quant-fp8", ["fp8"]), ("--quant-fp4", ["fp4"]), ("--quant-all", ["none", "fp8", "fp4"])],
)
def test_quant_flags(flag, modes):
    assert bench.quant_modes(bench.build_parser().parse_args([flag])) == modes


@pytest.mark.parametrize("pair", [("--no-quant", "--quant-fp8"), ("--quant-fp8", "--quant-fp4"), ("--quant-all", "--no-quant")])
def test_quant_flags_are_mutually_exclusive(pair, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.build_parser().parse_args(list(pair))
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--dtypes", "int8"], ["--trials", "0"], ["--seq-lens", "-4"], ["--hidden-dim"]])
def test_parser_rejects_bad_values(argv):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(argv)


def test_parser_lists_and_switches():
    args = bench.build_parser().parse_args(
        ["--hidden-dim", "1024", "4096", "--seq-lens", "1", "4096", "--dtypes", "float16", "float32", "--no-residual",
         "--disable-oneshot", "--ops-per-graph", "7"]
    )
    assert args.hidden_dim == [1024, 4096] and args.seq_lens == [1, 4096]
    assert args.dtypes == ["float16", "float32"]
    assert bench.residual_modes(args) == [False]
    assert args.disable_oneshot and args.ops_per_graph == 7
    assert bench.residual_modes(bench.build_parser().parse_args(["--residual-only"])) == [True]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--residual-only", "--no-residual"])


@pytest.mark.parametrize(
    "times, errors, expected",
    [
        ({"standard_allreduce_rmsnorm": 0.02, "standard_allreduce_rmsnorm_native_compiled": 0.03}, {}, "standard_allreduce_rmsnorm"),
        ({"standard_allreduce_rmsnorm": 0.02, "standard_allreduce_rmsnorm_native_compiled": 0.015}, {},
         "standard_allreduce_rmsnorm_native_compiled"),
        ({"standard_allreduce_rmsnorm": None, "standard_allreduce_rmsnorm_native_compiled": 0.03},
         {"standard_allreduce_rmsnorm": "RuntimeError: x"}, "standard_allreduce_rmsnorm_native_compiled"),
        ({"standard_allreduce_rmsnorm": 0.02, "flashinfer_fused_allreduce_rmsnorm_oneshot": 0.005}, {},
         "standard_allreduce_rmsnorm"),
        ({"standard_allreduce_rmsnorm": None, "flashinfer_raw_oneshot": 0.005}, {"standard_allreduce_rmsnorm": "E"}, None),
    ],
)
def test_baseline_is_the_faster_successful_standard_path(times, errors, expected):
    baseline = choose_baseline(config(times, errors).paths)
    assert (baseline.name if baseline else None) == expected


def test_text_table():
    cfg = config(
        {"standard_allreduce_rmsnorm": 0.012, "standard_allreduce_rmsnorm_native_compiled": 0.016,
         "flashinfer_fused_allreduce_rmsnorm_oneshot": 0.004, "flashinfer_fused_allreduce_rmsnorm_twoshot": None},
        {"flashinfer_fused_allreduce_rmsnorm_twoshot": "rank 1: FusionInputError: too big"},
        seq_len=64, hidden_dim=1024, quant_mode="fp8",
    )
    cfg.paths[0].rel_l2_error = 0.0022
    lines = format_table(cfg).splitlines()
    assert lines[0] == "Configuration: seq_len=64, hidden_dim=1024, dtype=bfloat16, residual=True, quant_mode=fp8"
    assert lines[1].split() == ["Operation", "Time", "(ms)", "Speedup"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:7]}
    assert rows["standard_allreduce_rmsnorm"] == ["0.0120", "baseline"]
    assert rows["standard_allreduce_rmsnorm_native_compiled"] == ["0.0160", "0.75x"]
    assert rows["flashinfer_fused_allreduce_rmsnorm_oneshot"] == ["0.0040", "3.00x"]
    assert rows["flashinfer_fused_allreduce_rmsnorm_twoshot"] == ["failed", "-"]
    assert "failed: flashinfer_fused_allreduce_rmsnorm_twoshot: rank 1: FusionInputError: too big" in lines[7]
    assert "standard_allreduce_rmsnorm 0.0022" in lines[8]
    time_col = lines[1].index("Time (ms)") + len("Time (ms)")
    assert all(line[time_col - 1] != " " for line in lines[3:7]), "times are right-aligned under their header"


def test_markdown_table():
    cfg = config({"standard_allreduce_rmsnorm": 0.01, "flashinfer_raw_oneshot": 0.004,
                  "flashinfer_fused_allreduce_rmsnorm_oneshot": 0.0041}, residual=False)
    md = format_markdown(cfg).splitlines()
    assert md[0] == f"### {config_header(cfg)}"
    assert "residual=False" in md[0]
    assert md[2] == "| Operation | Time (ms) | Speedup |"
    assert md[4] == "| standard_allreduce_rmsnorm | 0.0100 | baseline |"
    assert md[5] == "| flashinfer_raw_oneshot | 0.0040 | 2.50x |"
    assert "- arfusion one-shot vs raw flashinfer call: +2.5%" in md


def test_json_document_round_trips_with_speedups():
    cfgs = [
        config({"standard_allreduce_rmsnorm": 0.02, "standard_allreduce_rmsnorm_native_compiled": 0.01,
                "flashinfer_fused_allreduce_rmsnorm_oneshot": 0.005, "flashinfer_raw_oneshot": 0.004}),
        config({"standard_allreduce_rmsnorm": None}, {"standard_allreduce_rmsnorm": "OOM"}, seq_len=4096),
    ]
    doc = json.loads(json.dumps(json_document({"world_size": 2}, cfgs, ["skipped: FP4 needs sm100+"])))
    assert doc["skipped"] == ["skipped: FP4 needs sm100+"]
    first, second = doc["configs"]
    assert first["baseline"] == "standard_allreduce_rmsnorm_native_compiled"
    speedups = {p["name"]: p["speedup"] for p in first["paths"]}
    assert speedups == pytest.approx({"standard_allreduce_rmsnorm": 0.5, "standard_allreduce_rmsnorm_native_compiled": 1.0,
                                      "flashinfer_fused_allreduce_rmsnorm_oneshot": 2.0, "flashinfer_raw_oneshot": 2.5})
    assert first["arfusion_overhead_vs_raw"] == pytest.approx(0.25)
    assert first["paths"][0]["time_ms_per_rank"] == pytest.approx([0.0198, 0.02])
    assert second["baseline"] is None and second["paths"][0]["error"] == "OOM"
    assert overhead_vs_raw(cfgs[1]) is None


def test_recorder_writes_markdown_and_json(tmp_path, capsys):
    args = bench.build_parser().parse_args(["--output-file", str(tmp_path / "r.md"), "--json-file", str(tmp_path / "r.json")])
    recorder = bench.Recorder(args, {"world_size": 2, "device": "test"}, rank=0)
    recorder.skip(bench.FP4_SKIPPED)
    recorder.add(config({"standard_allreduce_rmsnorm": 0.01, "flashinfer_fused_allreduce_rmsnorm_oneshot": 0.005}))
    printed = capsys.readouterr().out
    assert "skipped: FP4 needs sm100+" in printed and "2.00x" in printed
    md = (tmp_path / "r.md").read_text()
    assert "- skipped: FP4 needs sm100+" in md and "| flashinfer_fused_allreduce_rmsnorm_oneshot | 0.0050 | 2.00x |" in md
    assert json.loads((tmp_path / "r.json").read_text())["configs"][0]["baseline"] == "standard_allreduce_rmsnorm"


def test_recorder_on_other_ranks_is_silent(tmp_path, capsys):
    args = bench.build_parser().parse_args(["--output-file", str(tmp_path / "r.md")])
    bench.Recorder(args, {}, rank=1).add(config({"standard_allreduce_rmsnorm": 0.01}))
    assert capsys.readouterr().out == "" and not (tmp_path / "r.md").exists()


def _plot_doc() -> dict:
    cfgs = [
        config({"standard_allreduce_rmsnorm": 0.01 * n, "flashinfer_fused_allreduce_rmsnorm_oneshot": 0.004 * n},
               seq_len=n, hidden_dim=h, quant_mode=q, residual=r)
        for n in (64, 1, 8) for h in (1024, 4096) for q in ("none", "fp8") for r in (True, False)
    ]
    return json.loads(json.dumps(json_document({"world_size": 2, "device": "test"}, cfgs, [])))


def test_plot_series_group_by_panel_and_sort_by_tokens():
    series = speedup_series(_plot_doc())
    assert len(series) == 4  # (dtype, quant, residual) panels
    line = series[("bfloat16", "fp8", True)][(4096, "flashinfer_fused_allreduce_rmsnorm_oneshot")]
    assert [n for n, _ in line] == [1, 8, 64]
    assert all(s == pytest.approx(2.5) for _, s in line)
    assert all(name != "standard_allreduce_rmsnorm" for lines in series.values() for _, name in lines), "baseline is not drawn"


@pytest.mark.timeout(120)
def test_plot_script_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    src, out = tmp_path / "r.json", tmp_path / "r.png"
    src.write_text(json.dumps(_plot_doc()))
    script = SCRIPT.parent / "plot_fused_collective.py"
    proc = subprocess.run([sys.executable, str(script), str(src), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
