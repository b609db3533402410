"""MMLU in simple-evals' form (``--style simple-evals``): zero-shot chat completions, the letter
after the last "Answer:", ``--examples`` questions sampled from all subjects; against the
scripted fake server, and through the accuracy regression runner."""
import json
from pathlib import Path

import pytest

from arfusion.benchmarks import accuracy_regression as regression
from arfusion.benchmarks.mmlu import bench as mmlu_bench
from arfusion.benchmarks.mmlu import scoring
from tests.fixtures.fake_openai_server import ThreadedServer, build_app, fixture_replies

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("reply, letter", [("Answer: B", "B"), ("so B.\nAnswer: **c**", "C"), ("answer : $D$", "D"),
                                           ("Answer: A\n...on reflection\nAnswer: C", "C"), ("The answer is B", None),
                                           ("Answer: E", None)])
def test_the_letter_after_the_last_answer_line(reply, letter):
    assert scoring.parse_answer_line(reply) == letter


def test_chat_prompt_holds_the_instruction_and_lettered_options():
    q = scoring.McQuestion("What is 2 + 2?", ("3", "4", "5", "6"), "B")
    prompt = scoring.build_chat_prompt(q)
    assert prompt.startswith(scoring.CHAT_INSTRUCTION) and prompt.endswith("What is 2 + 2?\n\nA) 3\nB) 4\nC) 5\nD) 6")


def test_simple_evals_asks_a_seeded_sample_by_chat():
    app = build_app(fixture_replies())
    with ThreadedServer(app) as server:
        argv = ["--data-dir", str(FIXTURES / "mmlu"), "--style", "simple-evals", "--examples", "5",
                "--port", str(server.port), "--no-progress"]
        first = mmlu_bench.run(mmlu_bench.build_parser().parse_args(argv))
        second = mmlu_bench.run(mmlu_bench.build_parser().parse_args(argv))
    assert first.num_questions == 5 and first.accuracy == 1.0 and first.num_shots == 0
    assert [r["id"] for r in first.records] == [r["id"] for r in second.records]  # the same sample every run
    assert len({r["subject"] for r in first.records}) == 2  # drawn across subjects, not the first N of each
    assert all("messages" in b and b["max_tokens"] == 1024 and "Answer:" not in b["messages"][0]["content"].split("\n")[-1]
               for b in app.state.requests)


def test_simple_evals_is_zero_shot():
    with pytest.raises(SystemExit, match="zero-shot"):
        mmlu_bench.main(["--data-dir", str(FIXTURES / "mmlu"), "--style", "simple-evals", "--num-shots", "2"])


def test_the_regression_runs_simple_evals_mmlu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(regression, "SERVER_MODULE", "tests.fixtures.fake_openai_server")
    monkeypatch.chdir(REPO)
    argv = ["--evals", "mmlu", "--mmlu-data-dir", str(FIXTURES / "mmlu"), "--mmlu-style", "simple-evals",
            "--mmlu-examples", "6", "--parallel", "4", "--no-progress", "--log-dir", str(tmp_path / "logs"),
            "--output-file", str(tmp_path / "report.json"), "--server-timeout", "120",
            "--server-args", "--deterministic"]
    assert regression.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["runs"]["on"]["metrics"]["mmlu"]["accuracy"] == 1.0
    assert report["runs"]["on"]["metrics"]["mmlu"]["num_questions"] == 6
    assert report["runs"]["on"]["server_command"][-1] == "--deterministic"
    assert "mmlu accuracy, TP1 on vs TP1 off: +0.00 points" in capsys.readouterr().out
