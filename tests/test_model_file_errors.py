"""Broken model files (tests/model_files.py's CASES) are refused with one line naming the file
and the problem: in process by the loaders, fast, and by ``python -m arfusion.engine.launch_server``
with exit code 2 and no traceback, at TP1 and at TP2 (gloo), where every rank stops and the
error is printed once.
"""
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from arfusion.engine.runtime.model_runner import RunnerSettings, check_model_files
from arfusion.engine.tokenizers.serving import load_serving_tokenizer
from arfusion.engine.weights import load_model_weights
from arfusion.engine.weights.errors import ModelFileError, finite_cast
from tests.model_files import CASES, FOUND_WHILE_LOADING, BrokenModel, good_gguf, good_hf_dir
from tests.server_process import ROOT, free_port, pid_alive

pytestmark = pytest.mark.timeout(300)
CHECK_BUDGET_S = 5.0  # what the loader may take to refuse one of these small files
LAUNCH_TIMEOUT_S = 120.0  # a whole server start-up that fails: imports, and at TP2 a spawned rank
SERVER_CASES = ["gguf cut to 64 bytes", "gguf cut in half", "wrong magic", "gguf nan weights", "config.json {}",
                "config.json unknown architecture", "config.json invalid JSON", "safetensors cut in half",
                "safetensors tensor shape mismatch", "gguf missing tensor"]
TP2_CASES = ["gguf nan weights", "safetensors cut in half", "gguf tensor shape mismatch"]


def refusal(model: Path) -> ModelFileError:
    """The error the loaders raise for ``model``: at the check before any tensor is read, or
    while the tensors are read."""
    with pytest.raises(ModelFileError) as err:
        config, weights = load_model_weights(model)
        for _ in weights:
            pass
    return err.value


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_the_unbroken_files_load(tmp_path, kind):
    """The cases differ from these files only by what they break."""
    model = good_gguf(tmp_path / "m.gguf") if kind == "gguf" else good_hf_dir(tmp_path / "m")
    config, weights = load_model_weights(model)
    tensors = dict(weights)
    assert len(tensors) == 3 + 9 * config.num_hidden_layers
    assert all(bool(torch.isfinite(t).all()) and t.abs().sum() > 0 for t in tensors.values())
    assert check_model_files(RunnerSettings(model_path=str(model))) == config
    assert load_serving_tokenizer(str(model)).vocab_size >= 128


@pytest.mark.parametrize("case", list(CASES))
def test_the_loader_names_the_file_and_the_problem_in_one_line_fast(tmp_path, case):
    broken: BrokenModel = CASES[case](tmp_path)
    start = time.perf_counter()
    error = refusal(broken.model)
    elapsed = time.perf_counter() - start
    message = str(error)
    assert error.path == str(broken.named) and message.startswith(f"{broken.named}: "), message
    assert all(word in message for word in broken.words), message
    assert "\n" not in message
    assert elapsed < CHECK_BUDGET_S, (elapsed, message)


@pytest.mark.parametrize("case", [c for c in CASES if c not in FOUND_WHILE_LOADING])
def test_the_launch_check_refuses_before_any_tensor_is_read(tmp_path, case):
    """What the launcher checks before it starts a TP worker: everything but the values."""
    broken = CASES[case](tmp_path)
    with pytest.raises(ModelFileError, match="^" + str(broken.named)):
        check_model_files(RunnerSettings(model_path=str(broken.model)))


@pytest.mark.parametrize("case", ["gguf cut to 64 bytes", "gguf cut in half", "wrong magic"])
def test_the_gguf_tokenizer_refuses_a_broken_file_with_the_same_error(tmp_path, case):
    broken = CASES[case](tmp_path)
    with pytest.raises(ModelFileError) as err:
        load_serving_tokenizer(str(broken.model))
    assert str(err.value).startswith(f"{broken.named}: ") and all(w in str(err.value) for w in broken.words)


@pytest.mark.parametrize("values, dtype, words", [
    ([1.0, float("nan"), float("-inf"), 2.0], torch.float32, "1 NaN and 1 infinite values among its 4"),
    ([1.0, 7e4, -1e5, 2.0], torch.float16, "2 of 4 values exceed the range of float16 (max |w| 1e+05)"),
])
def test_finite_cast_names_the_tensor_and_what_is_not_finite(values, dtype, words):
    with pytest.raises(ModelFileError, match="^/m/x.safetensors: tensor 'w'") as err:
        finite_cast(torch.tensor(values), dtype, "w", "/m/x.safetensors")
    assert words in str(err.value)


def test_model_file_errors_pickle_with_their_parts():
    error = pickle.loads(pickle.dumps(ModelFileError("/m/config.json", "not valid JSON:\n line 1")))
    assert (str(error), error.path, error.problem) == ("/m/config.json: not valid JSON: line 1", "/m/config.json",
                                                       "not valid JSON: line 1")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[2]) == pgid and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def launch(model: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m arfusion.engine.launch_server --model-path model *args`` in its own process group, to
    its end; asserts that no process of the group outlives it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "arfusion.engine.launch_server", "--model-path", str(model),
                             "--port", str(free_port()), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    deadline = time.monotonic() + 10
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_members(proc.pid), "a TP rank outlived the launcher"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_refused_once(result: subprocess.CompletedProcess, broken: BrokenModel) -> None:
    """Exit code 2; stderr has exactly one line naming the file, with every word, and no traceback."""
    lines = [line for line in result.stderr.splitlines() if str(broken.named) in line]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {broken.named}: "), result.stderr
    assert all(word in lines[0] for word in broken.words), lines[0]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr


@pytest.mark.parametrize("case", SERVER_CASES)
def test_the_server_exits_2_naming_the_file(tmp_path, case):
    broken = CASES[case](tmp_path)
    assert_refused_once(launch(broken.model, "--device", "cpu"), broken)


@pytest.mark.parametrize("case", TP2_CASES)
def test_the_server_exits_2_naming_the_file_once_at_tp2(tmp_path, case):
    """The values' check runs on both ranks during the load: they agree, rank 1 exits quietly
    with code 2, rank 0 prints the error. The other cases are refused before rank 1 starts."""
    broken = CASES[case](tmp_path)
    result = launch(broken.model, "--device", "cpu", "--tp-size", "2")
    assert_refused_once(result, broken)
    assert "ERROR" not in result.stderr, result.stderr
    if case in FOUND_WHILE_LOADING:
        assert "TP workers exited: rank 1 with code 2" in result.stderr, result.stderr
