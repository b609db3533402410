"""GSM8K, MMLU and serving benchmark clients end to end against a scripted fake server, and the
accuracy regression runner (pure comparison logic, and full runs with the fake server launched
as its subprocess)."""
import asyncio
import functools
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arfusion.benchmarks import accuracy_regression as regression
from arfusion.benchmarks import bench_serving
from arfusion.benchmarks.gsm8k import bench as gsm8k_bench
from arfusion.benchmarks.gsm8k import scoring as gsm8k_scoring
from arfusion.benchmarks.mmlu import bench as mmlu_bench
from arfusion.benchmarks.mmlu import scoring as mmlu_scoring
from tests.fixtures.fake_openai_server import ThreadedServer, build_app

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def _gsm8k_questions() -> list[str]:
    return [r["question"] for r in gsm8k_bench.load_jsonl(FIXTURES / "gsm8k" / "test.jsonl")]


def test_gsm8k_end_to_end(tmp_path, capsys):
    q = _gsm8k_questions()
    replies = [
        (gsm8k_scoring.format_question(q[0]), " 36 - 30 = 6.\nThe answer is 6.\n\nQuestion: 99 more"),  # cut at "Question"
        (gsm8k_scoring.format_question(q[1]), " So they have 1,900 houses."),
        (gsm8k_scoring.format_question(q[2]), " The answer is -5 degrees."),
        (gsm8k_scoring.format_question(q[3]), " They cost $7.50 in total."),
        (gsm8k_scoring.format_question(q[4]), " I cannot tell."),
        (gsm8k_scoring.format_question(q[5]), " The answer is 150."),
    ]
    result_file = tmp_path / "gsm8k.jsonl"
    app = build_app(replies)
    with ThreadedServer(app) as server:
        argv = ["--data-path", str(FIXTURES / "gsm8k" / "test.jsonl"), "--num-shots", "2", "--port", str(server.port),
                "--parallel", "3", "--result-file", str(result_file), "--no-progress"]
        result = gsm8k_bench.run(gsm8k_bench.build_parser().parse_args(argv))
    assert [r["correct"] for r in result.records] == [True, True, True, True, False, False]
    assert result.accuracy == pytest.approx(4 / 6) and result.invalid == pytest.approx(1 / 6)
    assert result.records[0]["generation"] == " 36 - 30 = 6.\nThe answer is 6.", "cut at the stop sequence"
    assert result.output_throughput > 0
    sent = app.state.requests
    assert len(sent) == 6 and all(b["temperature"] == 0 and b["max_tokens"] == 256 for b in sent)
    assert all(b["stop"] == gsm8k_scoring.STOP for b in sent)
    assert all(b["prompt"].count("Question: ") == 3 for b in sent), "2 shots from train.jsonl + the question"
    out = capsys.readouterr().out
    assert "Accuracy: 0.667" in out and "Invalid: 0.167" in out and "Output throughput:" in out
    line = json.loads(result_file.read_text().splitlines()[-1])
    assert line["task"] == "gsm8k" and line["num_questions"] == 6 and line["num_shots"] == 2


def test_gsm8k_missing_train_file_is_clear(tmp_path):
    data = tmp_path / "test.jsonl"
    data.write_text((FIXTURES / "gsm8k" / "test.jsonl").read_text())
    args = gsm8k_bench.build_parser().parse_args(["--data-path", str(data), "--port", "1"])
    with pytest.raises(SystemExit, match="--train-path"):
        gsm8k_bench.run(args)


def test_mmlu_end_to_end(tmp_path, capsys):
    arith = mmlu_scoring.read_csv(FIXTURES / "mmlu" / "test" / "toy_arithmetic_test.csv")
    facts = mmlu_scoring.read_csv(FIXTURES / "mmlu" / "test" / "world_facts_test.csv")
    scripted = [" C", " (B)", " c.", " Answer: A", " B", " A", "", " Earth"]  # answers: C B C A D | A B C
    replies = [(mmlu_scoring.format_question(q, False), r) for q, r in zip(arith + facts, scripted)]
    app = build_app(replies)
    with ThreadedServer(app) as server:
        argv = ["--data-dir", str(FIXTURES / "mmlu"), "--num-shots", "2", "--port", str(server.port),
                "--parallel", "4", "--no-progress", "--result-file", str(tmp_path / "mmlu.jsonl")]
        result = mmlu_bench.run(mmlu_bench.build_parser().parse_args(argv))
    assert [r["prediction"] for r in result.records] == ["C", "B", "C", "A", "B", "A", None, None]
    assert result.subjects["toy_arithmetic"]["accuracy"] == pytest.approx(4 / 5)
    assert result.subjects["world_facts"]["accuracy"] == pytest.approx(1 / 3)
    assert result.accuracy == pytest.approx(5 / 8) and result.invalid == pytest.approx(2 / 8)
    assert result.macro_accuracy == pytest.approx((4 / 5 + 1 / 3) / 2)
    assert all(b["max_tokens"] == 2 for b in app.state.requests)
    assert app.state.requests[0]["prompt"].startswith(
        "The following are multiple choice questions (with answers) about toy arithmetic.\n\nWhat is 2 + 2?")
    out = capsys.readouterr().out
    assert "world_facts" in out and "overall (pooled)" in out and "0.625" in out


def test_mmlu_examples_cap_and_zero_shot():
    app = build_app([])
    with ThreadedServer(app) as server:
        argv = ["--data-dir", str(FIXTURES / "mmlu"), "--num-shots", "0", "--examples", "2", "--subjects", "world_facts",
                "--port", str(server.port), "--no-progress"]
        result = mmlu_bench.run(mmlu_bench.build_parser().parse_args(argv))
    assert result.num_questions == 2 and result.invalid == 1.0
    assert all(b["prompt"].count("Answer:") == 1 for b in app.state.requests)


@pytest.mark.parametrize("send_usage", [True, False])
def test_bench_serving_end_to_end(tmp_path, capsys, send_usage):
    output = tmp_path / "serving.jsonl"
    app = build_app([], send_usage=send_usage)
    with ThreadedServer(app) as server:
        argv = ["--port", str(server.port), "--dataset-name", "random", "--random-input-len", "20",
                "--random-output-len", "5", "--random-range-ratio", "1", "--num-prompts", "6", "--max-concurrency", "2",
                "--warmup-requests", "2", "--output-file", str(output), "--no-progress"]
        assert bench_serving.main(argv) == 0
        assert bench_serving.main(argv) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(lines) == 2, "one JSON line appended per run"
    row = lines[0]
    assert set(bench_serving.COLUMNS) <= set(row)
    assert (row["completed"], row["failed"], row["total_output_tokens"], row["total_input_tokens"]) == (6, 0, 30, 120)
    assert row["per_user_throughput"] == pytest.approx(row["output_throughput"] / 2)
    assert row["mean_ttft_ms"] > 0 and row["p99_tpot_ms"] >= 0
    measured = app.state.requests[-6:]
    assert all(b["ignore_eos"] and b["max_tokens"] == 5 and b["stream"] for b in measured)
    assert all(b["stream_options"] == {"include_usage": True} for b in measured)
    assert "max_concurrency" in capsys.readouterr().out


@pytest.mark.parametrize("given, context, fitted", [
    ((None, None), None, (1024, 1024)),
    ((None, None), 2048, (512, 512)),
    ((None, None), 8192, (1024, 1024)),
    ((100, None), 2048, (100, 512)),
    ((1500, 548), 2048, (1500, 548)),
])
def test_lengths_fit_the_served_context(given, context, fitted):
    assert bench_serving.fit_lengths(*given, context) == fitted


def test_lengths_that_cannot_fit_are_refused_with_what_to_pass():
    with pytest.raises(SystemExit, match=r"--random-input-len 1024 \+ --random-output-len 1024 = 2048 tokens exceed the "
                                         r"served model's context length 2000; .*e\.g\. --random-input-len 500 "
                                         r"--random-output-len 500"):
        bench_serving.fit_lengths(1024, 1024, 2000)


def test_bench_serving_measures_tokens_per_word_and_fits_the_context(tmp_path, capsys):
    """A byte-level tokenizer (one token per byte, plus BOS) and a context of 400 tokens: the
    defaults become 100 input and 100 output tokens, and the prompts have about 100 tokens."""
    app = build_app([], context_length=400, prompt_tokens=lambda prompt: len(prompt.encode()) + 1)
    output = tmp_path / "serving.jsonl"
    with ThreadedServer(app) as server:
        argv = ["--port", str(server.port), "--num-prompts", "8", "--max-concurrency", "4", "--warmup-requests", "0",
                "--output-file", str(output), "--no-progress"]
        assert bench_serving.main(argv) == 0
        with pytest.raises(SystemExit, match="e.g. --random-input-len 100 --random-output-len 100"):
            bench_serving.main([*argv, "--random-input-len", "300", "--random-output-len", "200"])
    row = json.loads(output.read_text())
    assert (row["context_length"], row["random_input_len"], row["random_output_len"]) == (400, 100, 100)
    assert row["total_output_tokens"] == 800 and 8 * 85 <= row["total_input_tokens"] <= 8 * 115, row
    assert "context length 400; input 100 and output 100 tokens" in capsys.readouterr().out


def test_bench_serving_help_states_every_default():
    for action in bench_serving.build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and ("(default: " in action.help or action.const is True), action.option_strings


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_random_request_lengths(ratio):
    specs = bench_serving.random_requests(200, 40, 10, ratio, seed=3)
    assert specs == bench_serving.random_requests(200, 40, 10, ratio, seed=3), "seeded"
    assert all(max(1, int(40 * ratio)) <= s.input_len <= 40 and len(s.prompt.split()) == s.input_len for s in specs)
    assert all(max(1, int(10 * ratio)) <= s.output_len <= 10 for s in specs)
    assert len({s.prompt for s in specs}) == 200


def test_bench_serving_counts_failed_requests():
    specs = bench_serving.random_requests(2, 4, 3, 1.0, seed=0)
    with ThreadedServer(build_app([])) as server:
        outcomes, duration = asyncio.run(
            bench_serving.benchmark(f"http://127.0.0.1:{server.port}", specs, [], 1, progress=False))
    row = bench_serving.summarize(specs, [outcomes[0], RuntimeError("boom")], duration, 1)
    assert (row["completed"], row["failed"], row["total_output_tokens"]) == (1, 1, 3)
    with pytest.raises(RuntimeError, match="all 2 requests failed"):
        bench_serving.summarize(specs, [RuntimeError("a"), RuntimeError("b")], duration, 1)


# ----- accuracy regression runner -----

def _records(texts):
    return [{"id": str(i), "generation": t} for i, t in enumerate(texts)]


@pytest.mark.parametrize("off, on, agreement, identical", [
    (["a b c", "x y"], ["a b c", "x y"], 1.0, 1.0),
    (["a b c d", "x y"], ["a b z d", "x y"], 5 / 6, 0.5),
    (["a b c"], ["a b c d e"], 3 / 5, 0.0),
    (["a  b"], ["a b"], 1.0, 0.0),                     # whitespace differs, tokens agree
    (["", ""], ["", ""], 1.0, 1.0),
])
def test_generation_agreement(off, on, agreement, identical):
    result = regression.generation_agreement(_records(off), list(reversed(_records(on))))  # matched by id
    assert result == {"questions": len(off), "agreement": pytest.approx(agreement), "identical": identical}


@pytest.mark.parametrize("acc_on, tolerance, code", [(0.62, 1.5, 0), (0.635, 1.5, 0), (0.64, 1.5, 1), (0.58, 1.5, 1), (0.58, 5.0, 0)])
def test_compare_and_exit_code(acc_on, tolerance, code):
    off = {"gsm8k": {"accuracy": 0.62, "invalid": 0.01, "latency_s": 10.0, "output_throughput": 900.0},
           "mmlu": {"accuracy": 0.7, "invalid": 0.0, "latency_s": 3.0}}
    on = {"gsm8k": {"accuracy": acc_on, "invalid": 0.02, "latency_s": 8.0, "output_throughput": 1000.0},
          "mmlu": {"accuracy": 0.7, "invalid": 0.0, "latency_s": 2.0}}
    rows = regression.compare(off, on, tolerance)
    by_metric = {r["metric"]: r for r in rows}
    assert by_metric["gsm8k accuracy (%)"]["diff"] == pytest.approx((acc_on - 0.62) * 100)
    assert by_metric["gsm8k output_throughput"]["diff"] == pytest.approx(100.0)
    assert "mmlu output_throughput" not in by_metric
    assert not by_metric["gsm8k latency_s"]["checked"] and by_metric["mmlu accuracy (%)"]["checked"]
    assert regression.exit_code(rows) == code
    table = regression.format_table(rows, {"gsm8k": {"agreement": 0.9, "identical": 0.5, "questions": 4}})
    assert table.splitlines()[0].split() == ["metric", "off", "on", "diff"]
    assert ("EXCEEDS TOLERANCE" in table) == bool(code)
    assert "gsm8k generation agreement: 0.9000" in table


def _regression_args(extra=()):
    argv = ["--model-path", "/m", "--tp-size", "2", "--device", "cpu", "--allreduce-fusion-backend", "torch",
            "--server-args", "--seed 3 --dtype float32", "--gsm8k-data-path", "x", "--evals", "gsm8k", *extra]
    return regression.build_parser().parse_args(argv)


def test_server_command_passes_only_given_flags():
    off = regression.server_command(_regression_args(), fusion=False, port=1234)
    on = regression.server_command(_regression_args(), fusion=True, port=1234)
    assert off[1:3] == ["-m", "arfusion.engine.launch_server"]
    assert off[3:] == ["--host", "127.0.0.1", "--port", "1234", "--model-path", "/m", "--tp-size", "2", "--device", "cpu",
                       "--allreduce-fusion-backend", "torch", "--seed", "3", "--dtype", "float32"]
    assert on == off[:15] + ["--enable-flashinfer-allreduce-fusion"] + off[15:]
    assert "--load-format" not in off


def test_wait_for_health_reports_a_dying_server(tmp_path):
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-c", "import sys; print('loading weights'); print('CUDA error: out of memory'); sys.exit(4)"]
    with pytest.raises(regression.ServerFailed, match=r"(?s)exited with code 4.*out of memory"):
        with regression.running_server(cmd, "http://127.0.0.1:9", log, timeout_s=30):
            pass


def _run_regression(monkeypatch, tmp_path, env=None):
    monkeypatch.setattr(regression, "SERVER_MODULE", "tests.fixtures.fake_openai_server")
    monkeypatch.chdir(REPO)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    output = tmp_path / "regression.json"
    argv = ["--gsm8k-data-path", str(FIXTURES / "gsm8k" / "test.jsonl"), "--gsm8k-num-shots", "2",
            "--mmlu-data-dir", str(FIXTURES / "mmlu"), "--mmlu-num-shots", "2", "--mmlu-examples", "5",
            "--parallel", "4", "--no-progress", "--log-dir", str(tmp_path / "logs"), "--output-file", str(output),
            "--server-timeout", "120"]
    return regression.main(argv), output


def test_regression_end_to_end_pass(monkeypatch, tmp_path, capsys):
    code, output = _run_regression(monkeypatch, tmp_path)
    assert code == 0
    report = json.loads(output.read_text())
    assert report["passed"] and report["runs"]["on"]["server_info"]["fusion"]["enabled"] is True
    assert report["runs"]["off"]["metrics"]["gsm8k"]["accuracy"] == 1.0
    assert report["runs"]["on"]["metrics"]["mmlu"]["accuracy"] == 1.0
    assert report["generation_agreement"]["gsm8k"]["agreement"] == 1.0
    assert len(report["generations"]["mmlu"]) == 8
    assert "PASS" in capsys.readouterr().out


def test_regression_end_to_end_fail(monkeypatch, tmp_path):
    code, output = _run_regression(monkeypatch, tmp_path, {"FAKE_SERVER_WRONG_EVERY_WHEN_FUSED": "2"})
    assert code == 1
    report = json.loads(output.read_text())
    rows = {r["metric"]: r for r in report["comparison"]}
    assert rows["gsm8k accuracy (%)"]["diff"] == pytest.approx(-50.0) and rows["gsm8k accuracy (%)"]["exceeds"]
    assert report["generation_agreement"]["gsm8k"]["identical"] == 0.5


def test_regression_server_failure_exit_code(monkeypatch, tmp_path, capsys):
    code, output = _run_regression(monkeypatch, tmp_path, {"FAKE_SERVER_EXIT_CODE": "5"})
    assert code == 3 and not output.exists()
    assert "refusing to start" in capsys.readouterr().err


@pytest.mark.parametrize("module, argv", [
    (bench_serving, ["--num-prompts", "1", "--warmup-requests", "0"]),
    (gsm8k_bench, ["--data-path", str(FIXTURES / "gsm8k" / "test.jsonl"), "--num-shots", "0", "--no-progress"]),
    (mmlu_bench, ["--data-dir", str(FIXTURES / "mmlu"), "--num-shots", "0", "--no-progress"]),
])
def test_unreachable_server_is_a_clear_error(module, argv):
    port = regression.free_port("127.0.0.1")
    with pytest.raises(SystemExit, match=f"cannot reach the server at http://127.0.0.1:{port}"):
        module.main([*argv, "--port", str(port)])


def test_gsm8k_download_and_offline_message(tmp_path, monkeypatch):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(FIXTURES / "gsm8k"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(gsm8k_bench, "RAW_URL", f"http://127.0.0.1:{httpd.server_address[1]}/{{split}}.jsonl")
        path = gsm8k_bench.download("train", tmp_path / "cache")
        assert path.read_bytes() == (FIXTURES / "gsm8k" / "train.jsonl").read_bytes()
        assert gsm8k_bench.download("train", tmp_path / "cache") == path, "cached"
    finally:
        httpd.shutdown()
        thread.join()
    monkeypatch.setattr(gsm8k_bench, "RAW_URL", f"http://127.0.0.1:{regression.free_port('127.0.0.1')}/{{split}}.jsonl")
    with pytest.raises(SystemExit, match="Offline\\? Pass --data-path"):
        gsm8k_bench.download("test", tmp_path / "cache")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_stop_server_kills_a_stubborn_server_and_its_workers():
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "w = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
              "print(w.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = int(proc.stdout.readline())
    regression.stop_server(proc, grace_s=0.5)
    proc.stdout.close()
    assert proc.returncode == -9, "SIGTERM ignored, so SIGKILL after the grace period"
    deadline = time.monotonic() + 30
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker), "the worker in the server's process group is killed too"
