"""The accuracy regression runner end to end against the real engine: tiny model, TP2 over
gloo, fusion off then on (torch backend). Accuracy of a dummy model is ~0; the pipeline must
run, report both settings, and, since the torch backend computes the same fp32 math, find
identical generations."""
import json
from pathlib import Path

import pytest

from benchmarks import accuracy_regression as regression

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_regression_runner_on_the_tiny_model(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    output = tmp_path / "regression.json"
    code = regression.main([
        "--tp-size", "2", "--device", "cpu", "--allreduce-fusion-backend", "torch",
        "--gsm8k-data-path", str(FIXTURES / "gsm8k" / "test.jsonl"), "--gsm8k-num-shots", "1",
        "--gsm8k-num-questions", "4", "--mmlu-data-dir", str(FIXTURES / "mmlu"), "--mmlu-num-shots", "1",
        "--mmlu-examples", "2", "--parallel", "4", "--no-progress", "--log-dir", str(tmp_path / "logs"),
        "--output-file", str(output), "--server-timeout", "120",
    ])
    report = json.loads(output.read_text())
    assert code == 0, report["comparison"]
    assert report["runs"]["on"]["server_info"]["fusion"]["active"] is True
    assert report["runs"]["off"]["server_info"]["fusion"]["active"] is False
    for name in ("gsm8k", "mmlu"):
        assert report["generation_agreement"][name]["identical"] == 1.0
