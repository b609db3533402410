"""The README's serving benchmark (``python -m arfusion.benchmarks.bench_serving --port 30000 --num-prompts
200 --max-concurrency 32``, no lengths given) against the README's default server
(``python -m arfusion.engine.launch_server``: the tiny model, context 2048, a byte-level tokenizer),
scaled down to 4 prompts of 32 output tokens: the input length fits the context (512 tokens of
text, measured on this tokenizer) and every request succeeds."""
import json

import pytest

from arfusion.benchmarks import bench_serving
from tests.server_process import ServerProcess

pytestmark = pytest.mark.timeout(180)


def test_readme_serving_benchmark_against_the_default_server(tmp_path):
    server = ServerProcess()
    output = tmp_path / "serving.jsonl"
    try:
        argv = ["--port", str(server.port), "--num-prompts", "4", "--max-concurrency", "4", "--warmup-requests", "0",
                "--random-output-len", "32", "--output-file", str(output), "--no-progress"]
        assert bench_serving.main(argv) == 0
    finally:
        server.kill()
    row = json.loads(output.read_text())
    assert (row["context_length"], row["random_input_len"], row["random_output_len"]) == (2048, 512, 32)
    assert (row["completed"], row["failed"], row["total_output_tokens"]) == (4, 0, 4 * 32), row
    assert 4 * 460 <= row["total_input_tokens"] <= 4 * 560, "prompts of about 512 byte tokens"
