"""A rank fault's log: the one line naming the culprit (the TP worker that died) comes first, at
error level, and the collective's long traceback on rank 0 only at debug level; a fault of rank
0's own (no worker to blame) keeps its traceback at error level, after the line."""
import logging
import threading
from typing import Optional

import pytest

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.scheduler import Scheduler
from arfusion.engine.supervision import supervisor as supervisor_module
from arfusion.engine.supervision.supervisor import Supervisor
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.fake_runner import FakeRunner, collect

pytestmark = pytest.mark.timeout(60)
CULPRIT = "TP worker rank 1 exited (code -9)"


class Workers:
    """The `WorkerSet` calls `Supervisor.fail` makes: ``culprit`` is the worker to blame (or None)."""

    def __init__(self, culprit: Optional[str]) -> None:
        self.culprit = culprit

    def wait_for_failure(self, timeout_s: float) -> Optional[str]:
        return self.culprit

    def kill(self) -> None:
        pass


class Exited(Exception):
    """Raised instead of the process exit."""


@pytest.mark.parametrize("culprit", [CULPRIT, None])
def test_a_failed_step_logs_the_line_naming_the_culprit_first(culprit, caplog, monkeypatch):
    monkeypatch.setattr(supervisor_module.os, "_exit", lambda code: (_ for _ in ()).throw(Exited(code)))
    supervisor = Supervisor(Workers(culprit))  # type: ignore[arg-type]
    exits = []

    def on_failure(why: str) -> None:
        try:
            supervisor.fail(f"the scheduler failed: {why}", scheduler.failure_traceback)
        except Exited as exc:
            exits.append(exc.args[0])

    scheduler = Scheduler(FakeRunner(fail_at=2), build_tiny_tokenizer(), max_prefill_tokens=64, on_failure=on_failure)
    _, emit = collect()
    scheduler.submit(Request([1, 2], SamplingParams(max_tokens=8, temperature=0), emit=emit))
    caplog.set_level(logging.DEBUG)
    thread = threading.Thread(target=scheduler.run_forever)
    thread.start()
    thread.join(timeout=30)
    assert exits == [1]
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    first = errors[0].getMessage()
    assert "injected forward failure" in first and first.endswith("shutting the server down")
    assert first.startswith(CULPRIT) if culprit else first.startswith("the scheduler failed")
    traced = [r for r in caplog.records if r.exc_info or "Traceback (most recent call last)" in r.getMessage()]
    assert traced and all(r.levelno == logging.DEBUG for r in traced if r is not errors[-1])
    assert (errors[-1] in traced) == (culprit is None)  # rank 0's own fault: its traceback at error level
    assert len(errors) == (1 if culprit else 2)
