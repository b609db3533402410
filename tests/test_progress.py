"""Start-up progress lines (`engine.common.progress`): throttled by time, not by item, with
counts, bytes and rate; silent below INFO (``--log-level warning``) and where disabled (TP ranks
other than 0). tests/test_warm_up.py checks the lines a TP2 start-up logs on each rank."""
from __future__ import annotations

import logging

import pytest

from arfusion.engine.common.progress import Progress, track
from arfusion.server_args import ServerArgs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "arfusion.engine.progress"]


def test_one_line_per_interval_whatever_the_number_of_items(caplog):
    caplog.set_level(logging.INFO, logger="arfusion.engine.progress")
    clock = Clock()
    progress = Progress("loading weights", 1000, "tensors", total_bytes=2_000_000_000, interval_s=5.0, clock=clock)
    for _ in range(1000):  # 1000 tensors of 2 MB over 23 s
        clock.now += 0.023
        progress.advance(1, 2_000_000)
    progress.finish()
    lines = _lines(caplog)
    assert lines[0] == "loading weights: 1000 tensors (2000.0 MB)"
    assert len(lines) == 1 + 23 // 5 + 1, lines
    assert lines[1] == "loading weights: 218/1000 tensors, 436.0/2000.0 MB, 87.0 MB/s, 5 s"
    assert lines[-1] == "loading weights: done, 1000 tensors, 2000.0 MB in 23 s (87.0 MB/s)"


def test_track_advances_after_each_item_and_finishes(caplog):
    caplog.set_level(logging.INFO, logger="arfusion.engine.progress")
    clock = Clock()
    items = [("a", 10), ("b", 20), ("c", 30)]
    progress = Progress("warming up", 3, "steps", interval_s=0.0, clock=clock)
    assert list(track(items, progress, lambda item: item[1])) == items
    assert progress.done_items == 3 and progress.done_bytes == 60
    assert _lines(caplog)[1:] == ["warming up: 1/3 steps, 0 s", "warming up: 2/3 steps, 0 s", "warming up: 3/3 steps, 0 s",
                                  "warming up: done, 3 steps in 0 s"]


@pytest.mark.parametrize("level,enabled", [(logging.WARNING, True), (logging.INFO, False)])
def test_silent_below_info_and_where_disabled(caplog, level, enabled):
    caplog.set_level(level, logger="arfusion.engine.progress")
    progress = Progress("capturing CUDA graphs", 4, "batch sizes", interval_s=0.0, enabled=enabled)
    for _ in range(4):
        progress.advance()
    progress.finish()
    assert _lines(caplog) == []
    assert ServerArgs.from_cli(["--log-level", "warning"]).log_level == "warning"

