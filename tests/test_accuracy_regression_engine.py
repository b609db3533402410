"""The accuracy regression runner: the baseline column and its check, resuming from kept results
(against the scripted fake server), and end to end against the real engine: tiny model, a TP1
baseline, TP2 over gloo with fusion off then on (torch backend). Accuracy of a dummy model is ~0;
the pipeline must run, report every setting, and, since the torch backend computes the same fp32
math, find identical generations for on and off."""
import json
from pathlib import Path

import pytest

from arfusion.benchmarks import accuracy_regression as regression
from arfusion.benchmarks.accuracy_compare import compare, exit_code, format_table

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("baseline_acc, code", [(0.625, 0), (0.60, 1), (0.64, 1)])
def test_baseline_column_and_check(baseline_acc, code):
    off = {"gsm8k": {"accuracy": 0.62, "latency_s": 10.0, "output_throughput": 900.0}}
    on = {"gsm8k": {"accuracy": 0.62, "latency_s": 8.0, "output_throughput": 1000.0}}
    baseline = {"gsm8k": {"accuracy": baseline_acc, "latency_s": 12.0, "output_throughput": 700.0}}
    rows = {r["metric"]: r for r in compare(off, on, 1.0, baseline, 1.0)}
    acc = rows["gsm8k accuracy (%)"]
    assert acc["baseline"] == pytest.approx(baseline_acc * 100)
    assert acc["baseline_diff"] == pytest.approx((0.62 - baseline_acc) * 100)
    assert acc["baseline_exceeds"] == bool(code) and not acc["exceeds"]
    assert not rows["gsm8k latency_s"]["baseline_exceeds"], "only accuracy is checked"
    assert exit_code(list(rows.values())) == code
    table = format_table(list(rows.values()), {}, {}, {"baseline": "TP1", "off": "TP2 off", "on": "TP2 on"})
    assert [h.strip() for h in table.splitlines()[0].split("  ") if h.strip()] == [
        "metric", "TP1", "TP2 off", "TP2 on", "on - off", "off - baseline"]
    assert ("EXCEEDS BASELINE TOLERANCE" in table) == bool(code)


@pytest.mark.parametrize("active, code", [(True, 0), (False, 1)])
def test_inactive_fusion_fails_the_comparison(tmp_path, capsys, active, code):
    args = regression.build_parser().parse_args(["--evals", "gsm8k", "--output-file", str(tmp_path / "r.json")])
    args.evals = ["gsm8k"]
    records = {"gsm8k": [{"id": "0", "generation": " 6", "correct": True}]}
    run = {"server_command": [], "metrics": {"gsm8k": {"accuracy": 0.5}}, "records": records}
    runs = {"off": {**run, "server_info": {"fusion": {"active": False}}},
            "on": {**run, "server_info": {"fusion": {"active": active, "reason_inactive": None if active else "no GPU"}}}}
    assert regression.report(args, runs, {"off": "TP2 off", "on": "TP2 on"}) == code
    assert ("fusion was not active in the on run (no GPU)" in capsys.readouterr().out) == (not active)


def _fake_argv(tmp_path, *extra):
    return ["--gsm8k-data-path", str(FIXTURES / "gsm8k" / "test.jsonl"), "--gsm8k-num-shots", "2",
            "--mmlu-data-dir", str(FIXTURES / "mmlu"), "--mmlu-num-shots", "2", "--parallel", "4", "--no-progress",
            "--log-dir", str(tmp_path / "logs"), "--results-dir", str(tmp_path / "results"),
            "--output-file", str(tmp_path / "report.json"), "--server-timeout", "120", *extra]


def test_results_dir_resumes_only_what_is_missing(monkeypatch, tmp_path, capsys):
    """A second run reuses every kept (setting, eval) result; one deleted result is run again
    (here by a server that answers wrongly when fused: only that eval changes); changed options
    are not reused."""
    monkeypatch.setattr(regression, "SERVER_MODULE", "tests.fixtures.fake_openai_server")
    monkeypatch.chdir(REPO)
    assert regression.main(_fake_argv(tmp_path, "--baseline-tp-size", "1")) == 0
    kept = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert kept == [f"{s}_{e}.json" for s in ("baseline", "off", "on") for e in ("gsm8k", "mmlu")]
    (tmp_path / "results" / "on_mmlu.json").unlink()
    monkeypatch.setenv("FAKE_SERVER_WRONG_EVERY_WHEN_FUSED", "2")
    capsys.readouterr()
    assert regression.main(_fake_argv(tmp_path, "--baseline-tp-size", "1")) == 1
    out = capsys.readouterr().out
    assert out.count("reusing") == 5 and out.count("arfusion.engine.launch_server") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {r["metric"]: r for r in report["comparison"]}
    assert rows["gsm8k accuracy (%)"]["diff"] == 0.0 and rows["mmlu accuracy (%)"]["diff"] < 0
    assert report["titles"] == {"baseline": "TP1", "off": "TP1 off", "on": "TP1 on"}
    capsys.readouterr()
    assert regression.main(_fake_argv(tmp_path, "--baseline-tp-size", "1", "--gsm8k-num-questions", "3")) == 1
    assert "run with other options: running gsm8k again" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_regression_runner_on_the_tiny_model(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    output = tmp_path / "regression.json"
    argv = [
        "--tp-size", "2", "--baseline-tp-size", "1", "--device", "cpu", "--allreduce-fusion-backend", "torch",
        "--gsm8k-data-path", str(FIXTURES / "gsm8k" / "test.jsonl"), "--gsm8k-num-shots", "1",
        "--gsm8k-num-questions", "4", "--mmlu-data-dir", str(FIXTURES / "mmlu"), "--mmlu-num-shots", "1",
        "--mmlu-examples", "2", "--parallel", "4", "--no-progress", "--log-dir", str(tmp_path / "logs"),
        "--results-dir", str(tmp_path / "results"), "--output-file", str(output), "--server-timeout", "300",
    ]
    code = regression.main(argv)
    report = json.loads(output.read_text())
    assert code == 0, report["comparison"]
    assert report["titles"] == {"baseline": "TP1", "off": "TP2 off", "on": "TP2 on"}
    assert report["runs"]["on"]["server_info"]["fusion"]["active"] is True
    assert report["runs"]["off"]["server_info"]["fusion"]["active"] is False
    assert "--tp-size 1" in " ".join(report["runs"]["baseline"]["server_command"])
    for name in ("gsm8k", "mmlu"):
        assert report["generation_agreement"][name]["identical"] == 1.0
        assert report["baseline_generation_agreement"][name]["questions"] == 4
    gsm8k = {r["metric"]: r for r in report["comparison"]}["gsm8k output_throughput"]
    assert all(gsm8k[k] > 0 for k in ("baseline", "off", "on")), "every gsm8k run reports its token throughput"
    def no_server(*args, **kwargs):
        raise AssertionError("every result is kept: no server may start")

    monkeypatch.setattr(regression, "running_server", no_server)
    assert regression.main(argv) == 0 and json.loads(output.read_text())["runs"] == report["runs"]


@pytest.mark.parametrize("argv", [["--server-args", "--deterministic"], ["--server-args=--deterministic"],
                                  ["--server-args", "--deterministic --seed 1"]])
def test_server_args_take_a_single_flag(argv):
    args = regression.build_parser().parse_args(regression.join_server_args(argv + ["--evals", "gsm8k"]))
    assert args.server_args.split()[0] == "--deterministic" and args.evals == "gsm8k"
    assert regression.server_command(args, False, 1)[-len(args.server_args.split()):] == args.server_args.split()


def _run(correct_ids, n, active=None):
    records = [{"id": str(i), "generation": " x", "correct": i in correct_ids} for i in range(n)]
    info = {"fusion": {"active": active}} if active is not None else {"fusion": {}}
    return {"server_command": [], "server_info": info, "records": {"gsm8k": records},
            "metrics": {"gsm8k": {"accuracy": len(correct_ids) / n}}}


def test_noise_is_no_regression_but_a_significant_drop_is(tmp_path, capsys):
    """Full GSM8K as measured (1,319 questions): TP1 189 right; TP2 off 26 of them wrong and 12
    others right (McNemar p = 0.034); on against off 20 vs 19. Differences of 1.1 points that
    the fixed 1-point threshold failed: PASS. Then on loses 60 of off's answers: FAIL."""
    n = 1319
    baseline = set(range(189))
    off = set(range(26, 189)) | set(range(1000, 1012))
    on = (off - set(range(26, 46))) | set(range(1100, 1119))
    args = regression.build_parser().parse_args(["--evals", "gsm8k", "--output-file", str(tmp_path / "r.json")])
    args.evals = ["gsm8k"]
    titles = {"baseline": "TP1", "off": "TP2 off", "on": "TP2 on"}
    runs = {"baseline": _run(baseline, n), "off": _run(off, n), "on": _run(on, n, active=True)}
    assert regression.report(args, runs, titles) == 0
    out = capsys.readouterr().out
    assert "EXCEEDS" not in out and out.rstrip().endswith("PASS")
    assert "gsm8k accuracy, TP2 on vs TP2 off: -0.08 points" in out and "discordant 20 vs 19" in out
    assert "discordant 26 vs 12, McNemar exact p = 0.0336 -> PASS" in out
    assert "gsm8k generation agreement: 1.0000 of tokens" in out  # the agreement is printed as before
    paired = json.loads((tmp_path / "r.json").read_text())["paired"]["gsm8k"]
    assert paired["on_vs_off"]["verdict"] == "pass" and paired["off_vs_baseline"]["p_value"] == pytest.approx(0.03355, rel=1e-3)
    runs["on"] = _run(off - set(range(26, 86)), n, active=True)
    assert regression.report(args, runs, titles) == 1
    out = capsys.readouterr().out
    assert "-> FAIL" in out and "FAIL: an accuracy of on is significantly below off" in out
