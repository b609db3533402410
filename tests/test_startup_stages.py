"""A start-up a user can follow: each stage logs its start and end, the summary's parts add up
to the wall clock since the process started; node 0's process parses a GGUF file once (file,
tokenizer, config checks and rank 0's load share it); the context length defaults to the
model's own, cut to what the KV cache holds with the reason logged (never one the user set);
the server's log lines carry their time."""
from __future__ import annotations

import logging
import re
import time

import pytest

from arfusion.engine.common.startup import StartupStages
from tests.dist_utils import run_distributed
from tests.gguf_files import qwen2_chat_file
from tests.server_process import ServerProcess

pytestmark = pytest.mark.timeout(300)
SUMMARY = re.compile(r"start-up (\d+\.\d) s: (.*)$")


def parts_of(summary: str) -> tuple[float, dict[str, float]]:
    total, parts = SUMMARY.search(summary).groups()
    return float(total), {name: float(s) for name, s in re.findall(r"([\w -]+?) (\d+\.\d) s(?:, |$)", parts)}


def test_stages_log_their_start_and_end_and_add_up_to_the_wall_clock(caplog: pytest.LogCaptureFixture):
    logger = logging.getLogger("test.startup")
    with caplog.at_level(logging.INFO, logger="test.startup"):
        stages = StartupStages(logger, origin=time.perf_counter() - 0.3)  # 0.3 s before the first stage
        for name, seconds in (("file", 0.2), ("weights", 0.1), ("file", 0.1)):
            with stages.stage(name):
                time.sleep(seconds)
        summary = stages.summary()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" ")[1] for line in lines] == ["file", "file", "weights", "weights", "file", "file"]
    assert lines[0].startswith("start-up: file ... (at 0.3 s)") and "done in 0.2 s (at 0.5 s)" in lines[1]
    total, parts = parts_of(summary)
    assert list(parts) == ["file", "weights", "other"]
    assert parts["file"] == pytest.approx(0.3, abs=0.06) and parts["other"] == pytest.approx(0.3, abs=0.06)
    assert sum(parts.values()) == pytest.approx(total, abs=0.15), "the parts add up (each rounded to 0.1 s)"


def _load_counting_parses(rank: int, world_size: int, gguf: str) -> dict:
    """Node 0's start-up of ``gguf`` in this process (the launcher's files, then rank 0's runner)
    with every GGUF parse counted; the runner's context length and stages."""
    import arfusion.engine.weights.gguf_file as gguf_file
    from arfusion.engine.common.startup import StartupStages
    from arfusion.engine.launch_server import load_model_files
    from arfusion.engine.runtime.model_runner import StartupContext
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.layers.parallel_state import get_tp_group
    from arfusion.server_args import ServerArgs

    parses = []
    real = gguf_file.GGUFReader
    gguf_file.GGUFReader = lambda path, *a, **kw: parses.append(str(path)) or real(path, *a, **kw)
    startup = StartupContext(StartupStages(None))
    tokenizer, launch = load_model_files(ServerArgs(model_path=gguf, device="cpu"), startup)
    runner = build_runner(launch.runner, get_tp_group(), startup)
    try:
        return {"parses": parses, "stages": list(startup.stages.seconds), "context": runner.context_len,
                "vocab": tokenizer.vocab_size}
    finally:
        runner.destroy()


def test_node_0_parses_a_gguf_file_once(tmp_path):
    path, _ = qwen2_chat_file(tmp_path / "model.gguf")
    out = run_distributed(_load_counting_parses, world_size=1, args=(str(path),), timeout_s=120)[0]
    assert out["parses"] == [str(path)], "the file, the tokenizer, the checks and the load share one parse"
    assert out["stages"] == ["file", "tokenizer", "config", "weights", "fusion setup", "KV cache", "graphs"]
    assert out["context"] == 4096, "the model's own context length"


def _context(rank: int, world_size: int, context_length: int | None) -> tuple[int, list[str]]:
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.layers.parallel_state import get_tp_group

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("arfusion.engine.runtime.rank_parts").addHandler(handler)
    settings = RunnerSettings(model_path="tiny", context_length=context_length, max_running_requests=2, kv_slots=300)
    runner = build_runner(settings, get_tp_group())
    runner.destroy()
    return runner.context_len, records


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_default_context_is_the_models_cut_to_the_kv_cache_with_the_reason_logged(world_size: int):
    """The tiny model's 2048 positions do not fit 300 KV slots (one is scratch): cut to 299, the
    reason logged once; a length the user set is kept."""
    cut = run_distributed(_context, world_size=world_size, args=(None,), timeout_s=120)
    assert [context for context, _ in cut] == [299] * world_size
    assert [line for line in cut[0][1] if "context length" in line] == [
        "context length cut from the model's 2048 to 299 tokens: the KV cache is set to that size (--context-length sets it)"]
    kept = run_distributed(_context, world_size=1, args=(1024,), timeout_s=120)[0]
    assert kept == (1024, [])


def test_a_gguf_server_logs_each_stage_with_its_time_and_a_summary_that_adds_up(tmp_path):
    path, _ = qwen2_chat_file(tmp_path / "model.gguf")
    server = ServerProcess("--model-path", str(path), "--device", "cpu")
    try:
        log = server.log_text()
    finally:
        server.stop()
    lines = [line for line in log.splitlines() if "[tp0]" in line]
    assert lines and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[tp0\] ", line) for line in lines), lines[:3]
    for stage in ("file", "tokenizer", "config", "TP group", "weights", "fusion setup", "KV cache", "graphs", "warm-up"):
        assert sum(f"start-up: {stage} ... (at" in line for line in lines) == 1, stage
        assert sum(f"start-up: {stage} done in" in line for line in lines) == 1, stage
    serving = next(line for line in lines if " serving " in line)
    total, parts = parts_of(serving.rstrip(")"))
    assert "file" in parts and "warm-up" in parts and "other" in parts
    assert sum(parts.values()) == pytest.approx(total, abs=0.05 * len(parts) + 0.01)
