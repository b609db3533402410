"""`benchmarks/gpu/run.sh engine` with BASE (this checkout against an older one, interleaved
rounds) on the CPU: the tiny model, TP1, two rounds. The script runs in a copy of the tracked
files with a `.gpu/env.sh` that stands in for the GPU environment (an `nvidia-smi` that lists
nothing); BASE is a second copy. Checked: the part exits 0, each round runs both checkouts in
turn (the order swapped in round 2), each run imports `arfusion` from its own checkout, every run
writes its JSON, and the table has a row per setting with the rounds' TPOT and their ratio."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def copy_tracked(dest: Path) -> Path:
    """The repository's tracked files (as in the working tree) under ``dest``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.mark.timeout(600)
def test_engine_part_compares_two_checkouts_in_interleaved_rounds(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the tracked files are copied)")
    this, base, out = copy_tracked(tmp_path / "this"), copy_tracked(tmp_path / "base"), tmp_path / "out"
    (this / ".gpu").mkdir()
    (this / ".gpu" / "env.sh").write_text('nvidia-smi() { echo "(no GPU)"; }\n')
    env = dict(os.environ, OUT=str(out), MODEL="tiny", TP="1", BATCH="1", FUSION="off", ROUNDS="2", BASE=str(base),
               BUDGET_S="540", EXTRA_ARGS="--repeats 1 --output-len 8")
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "engine"], cwd=this, env=env, capture_output=True,
                          text=True, timeout=580)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    rounds = re.findall(r"^== round (\d): (this|base) \((.+)\)$", log, re.M)
    assert [(r, label) for r, label, _ in rounds] == [("1", "this"), ("1", "base"), ("2", "base"), ("2", "this")]
    imported = re.findall(r"^arfusion: (.+)$", log, re.M)[-4:]  # after the part's own check of this checkout
    assert [Path(p) for p in imported] == [Path(root).resolve() for _, _, root in rounds]
    assert sorted(p.name for p in out.glob("bench_one_batch_*.jsonl")) == [
        "bench_one_batch_base_1.jsonl", "bench_one_batch_base_2.jsonl", "bench_one_batch_this_1.jsonl",
        "bench_one_batch_this_2.jsonl"]
    row = re.search(r"^ +1 +off +False +([\d.]+) / ([\d.]+) +([\d.]+) / ([\d.]+) +([\d.]+)$", log, re.M)
    assert row, log[-2000:]
    base_1, base_2, this_1, this_2, ratio = map(float, row.groups())
    assert ratio == pytest.approx((this_1 + this_2) / (base_1 + base_2), rel=1e-2)  # medians of two rounds: means


@pytest.mark.timeout(600)
def test_engine_part_compares_a_flag_within_one_checkout(tmp_path):
    """BASE=. with THIS_ARGS: both sides run this checkout; only "this" gets the flags."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the tracked files are copied)")
    this, out = copy_tracked(tmp_path / "this"), tmp_path / "out"
    (this / ".gpu").mkdir()
    (this / ".gpu" / "env.sh").write_text('nvidia-smi() { echo "(no GPU)"; }\n')
    env = dict(os.environ, OUT=str(out), MODEL="tiny", TP="1", BATCH="1", FUSION="off", ROUNDS="1", BASE=".",
               THIS_ARGS="--seed 5", BUDGET_S="540", EXTRA_ARGS="--repeats 1 --output-len 8")
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "engine"], cwd=this, env=env, capture_output=True,
                          text=True, timeout=580)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    seeds = {label: json.loads((out / f"bench_one_batch_{label}_1.jsonl").read_text().splitlines()[0])["args"]["seed"]
             for label in ("this", "base")}
    assert seeds["this"] == 5 and seeds["base"] != 5, seeds
    assert re.search(r"^ +1 +off +False +[\d.]+ +[\d.]+ +[\d.]+$", log, re.M), log[-2000:]


@pytest.mark.timeout(900)
def test_engine_part_compares_several_checkouts_in_rotated_rounds(tmp_path):
    """BASE with two folders: three checkouts a round, the order rotated by one every round, each
    run importing its own checkout, a column and a ratio per base."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the tracked files are copied)")
    this, out = copy_tracked(tmp_path / "this"), tmp_path / "out"
    first, second = copy_tracked(tmp_path / "first"), copy_tracked(tmp_path / "second")
    (this / ".gpu").mkdir()
    (this / ".gpu" / "env.sh").write_text('nvidia-smi() { echo "(no GPU)"; }\n')
    env = dict(os.environ, OUT=str(out), MODEL="tiny", TP="1", BATCH="1", FUSION="off", ROUNDS="2",
               BASE=f"{first} {second}", BUDGET_S="840", EXTRA_ARGS="--repeats 1 --output-len 8")
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "engine"], cwd=this, env=env, capture_output=True,
                          text=True, timeout=880)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    rounds = re.findall(r"^== round (\d): (this|base\d) \((.+)\)$", log, re.M)
    assert [(r, label) for r, label, _ in rounds] == [("1", "this"), ("1", "base1"), ("1", "base2"),
                                                      ("2", "base1"), ("2", "base2"), ("2", "this")]
    assert {label: Path(root) for _, label, root in rounds} == {"this": this.resolve(), "base1": first.resolve(),
                                                                "base2": second.resolve()}
    imported = re.findall(r"^arfusion: (.+)$", log, re.M)[-6:]
    assert [Path(p) for p in imported] == [Path(root).resolve() for _, _, root in rounds]
    row = re.search(r"^ +1 +off +False" + r" +([\d.]+) / ([\d.]+)" * 3 + r" +([\d.]+) +([\d.]+)$", log, re.M)
    assert row, log[-2000:]
    first_1, first_2, second_1, second_2, this_1, this_2, ratio_1, ratio_2 = map(float, row.groups())
    assert ratio_1 == pytest.approx((this_1 + this_2) / (first_1 + first_2), rel=1e-2)
    assert ratio_2 == pytest.approx((this_1 + this_2) / (second_1 + second_2), rel=1e-2)
