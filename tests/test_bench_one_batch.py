"""`python -m arfusion.engine.bench_one_batch` end to end on CPU: the tiny model at TP2 over gloo, the
three settings in one run, the table and the JSON line; its --help lists only what it uses."""
import json
import re
import subprocess
import sys

import pytest
import torch

from arfusion.engine import bench_one_batch


def test_bench_one_batch_measures_every_setting_and_writes_json(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "arfusion.engine.bench_one_batch", "--tp-size", "2", "--batch-size", "1", "3",
         "--input-len", "6", "--output-len", "3", "--repeats", "1", "--fusion", "off", "on", "builtin",
         "--json-file", str(out)],
        capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TPOT gain on" in proc.stdout and "TPOT gain builtin" in proc.stdout, proc.stdout
    record = json.loads(out.read_text().splitlines()[-1])
    rows = {(r["fusion"], r["batch_size"]): r for r in record["results"]}
    assert set(rows) == {(s, b) for s in ("off", "on", "builtin") for b in (1, 3)}
    assert all(r["tpot_ms"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    assert not rows[("off", 1)]["fusion_active"] and rows[("on", 1)]["fusion_active"] and rows[("builtin", 1)]["fusion_active"]
    assert not rows[("builtin", 1)]["strategy_table"]


def test_bench_one_batch_measures_both_deterministic_modes_side_by_side(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "arfusion.engine.bench_one_batch", "--tp-size", "2", "--batch-size", "1", "3",
         "--input-len", "6", "--output-len", "3", "--repeats", "1", "--fusion", "off", "on",
         "--deterministic", "off", "on", "--json-file", str(out)],
        capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for column in ("TPOT det/default on", "prefill det/default off", "TPOT gain on det", "prefill on det"):
        assert column in proc.stdout, (column, proc.stdout)
    record = json.loads(out.read_text().splitlines()[-1])
    rows = {(r["fusion"], r["deterministic"], r["batch_size"]): r for r in record["results"]}
    assert set(rows) == {(s, d, b) for s in ("off", "on") for d in (False, True) for b in (1, 3)}
    assert all(r["tpot_ms"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    assert rows[("on", True, 1)]["fusion_active"], "batch-invariant mode keeps fusion on"


def test_bench_one_batch_rejects_an_unknown_setting():
    proc = subprocess.run([sys.executable, "-m", "arfusion.engine.bench_one_batch", "--fusion", "fast"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_bench_one_batch_without_overlap_records_it(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "arfusion.engine.bench_one_batch", "--batch-size", "2", "--input-len", "4", "--output-len", "3",
         "--repeats", "1", "--fusion", "on", "--disable-overlap-schedule", "--json-file", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no overlap" in proc.stdout
    # the spawned rank logs as a server's rank does (its INFO lines, e.g. the KV cache's size)
    assert re.search(r"\[tp0\] INFO arfusion\.engine\.runtime\.rank_parts: KV cache: \d+ token slots", proc.stderr), proc.stderr[-3000:]
    (row,) = json.loads(out.read_text().splitlines()[-1])["results"]
    assert row["overlap"] is False and row["tpot_ms"] > 0


SERVER_ONLY = ("--host", "--port", "--shutdown-timeout", "--max-running-requests", "--max-request-bytes",
               "--served-model-name", "--tokenizer-path", "--context-length", "--chunked-prefill-size",
               "--cuda-graph-max-bs", "--skip-server-warmup", "--nnodes", "--node-rank", "--dist-init-addr",
               "--enable-flashinfer-allreduce-fusion", "--max-prefill-tokens")


def test_help_lists_only_the_flags_it_uses(capsys):
    proc = subprocess.run([sys.executable, "-m", "arfusion.engine.bench_one_batch", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", proc.stdout))
    assert not flags & set(SERVER_ONLY), flags & set(SERVER_ONLY)
    assert {"--model-path", "--tp-size", "--allreduce-fusion-backend", "--disable-overlap-schedule", "--batch-size",
            "--fusion", "--deterministic"} <= flags
    for flag in SERVER_ONLY:
        with pytest.raises(SystemExit) as exited:
            bench_one_batch.parse_args([flag, "1"])
        assert exited.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err, flag


@pytest.mark.parametrize("cuda, default, shown", [(False, "torch", "(default: torch, as no CUDA GPU is visible)"),
                                                  (True, "flashinfer", "(default: flashinfer)")])
def test_the_fusion_backend_default_is_the_one_it_applies(monkeypatch, cuda, default, shown):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    help_text = " ".join(bench_one_batch.build_parser().format_help().split())
    option = help_text[help_text.index("--allreduce-fusion-backend {flashinfer,torch} flashinfer:"):]
    assert option[:option.index(" --", 3)].endswith(shown)
    server, _ = bench_one_batch.parse_args([])
    assert server.allreduce_fusion_backend == default
