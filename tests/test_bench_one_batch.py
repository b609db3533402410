"""`python -m engine.bench_one_batch` end to end on CPU: the tiny model at TP2 over gloo, the
three settings in one run, the table and the JSON line."""
import json
import subprocess
import sys


def test_bench_one_batch_measures_every_setting_and_writes_json(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench_one_batch", "--tp-size", "2", "--batch-size", "1", "3",
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


def test_bench_one_batch_rejects_an_unknown_setting():
    proc = subprocess.run([sys.executable, "-m", "engine.bench_one_batch", "--fusion", "fast"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_bench_one_batch_without_overlap_records_it(tmp_path):
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench_one_batch", "--batch-size", "2", "--input-len", "4", "--output-len", "3",
         "--repeats", "1", "--fusion", "on", "--disable-overlap-schedule", "--json-file", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no overlap" in proc.stdout
    (row,) = json.loads(out.read_text().splitlines()[-1])["results"]
    assert row["overlap"] is False and row["tpot_ms"] > 0
