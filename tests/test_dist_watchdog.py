"""The ``--dist-timeout`` watchdog of TP rank 0 (`engine.supervision.watchdog`) and the step
progress it reads (`engine.runtime.step_progress`), in one process: a real rendezvous store,
`HeartbeatMonitor` and `DistWatchdog`; the worker (rank 1) is this test writing its heartbeat
and its finished step into the store, so that it can go silent or stay behind at a known time;
rank 0's steps are a `Scheduler` driving a `FakeRunner` whose step blocks (a fused kernel that
waits forever on a peer, while every process stays alive and beats).

Bounds: the watchdog never fires before ``dist_timeout`` (from the last beat written, from the
start of the blocked step); it fires within its `detection_bound_s` after that, plus
``THREAD_ALLOWANCE_S`` for this process's threads being scheduled late on a loaded machine.
"""
import threading
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.step_progress import StepProgress
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.scheduler import Scheduler
from arfusion.engine.supervision.heartbeat import Heartbeat, HeartbeatMonitor, interval_s
from arfusion.engine.supervision.watchdog import DistWatchdog, detection_bound_s
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.fake_runner import FakeRunner, collect
from tests.server_process import free_port

pytestmark = pytest.mark.timeout(120)
DIST_TIMEOUT_S = 4.0
THREAD_ALLOWANCE_S = 2.0
WAIT_S = 60.0  # a generous bound on waits for what does happen


def test_step_progress_on_the_cpu_finishes_a_step_at_its_end():
    progress = StepProgress(torch.device("cpu"))
    assert progress.oldest_unfinished() is None and progress.finished == 0
    before = time.monotonic()
    assert progress.begin() == 1
    step, began_at = progress.oldest_unfinished()
    assert step == 1 and before <= began_at <= time.monotonic()
    progress.end()
    assert progress.oldest_unfinished() is None and progress.finished == 1
    assert progress.begin() == 2
    assert progress.begin() == 3  # step 2 had no end: it ended when step 3 began
    assert progress.finished == 2 and progress.oldest_unfinished()[0] == 3
    progress.end()
    progress.end()  # nothing begun: nothing to end
    assert progress.finished == 3 and progress.oldest_unfinished() is None


def test_a_worker_publishes_its_last_finished_step_beside_its_heartbeat():
    """The worker side of the step rule: `Heartbeat.watch_steps` raises the store's step to
    the worker's `StepProgress.finished`, which rank 0's monitor reads."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    init_method = f"tcp://127.0.0.1:{port}"
    heartbeat = Heartbeat(init_method, 2, DIST_TIMEOUT_S)
    monitor = HeartbeatMonitor(init_method, [2], DIST_TIMEOUT_S)
    progress = StepProgress(torch.device("cpu"))
    try:
        heartbeat.watch_steps(progress)
        for _ in range(3):
            progress.begin()
            progress.end()
        progress.begin()  # step 4 in flight: not published
        deadline = time.monotonic() + WAIT_S
        while monitor.finished_steps() != {2: 3}:
            assert time.monotonic() < deadline, monitor.finished_steps()
            time.sleep(0.01)
        time.sleep(4 * interval_s(DIST_TIMEOUT_S))
        assert monitor.finished_steps() == {2: 3} and master.add("arfusion/step/2", 0) == 3
    finally:
        heartbeat.stop()
        monitor.stop()


class Rank1:
    """TP worker rank 1 as the store sees it: ``beat`` (a thread, every beat interval, until
    `silence`) and ``finish(step)``; ``last_beat`` is when its last beat was written."""

    def __init__(self, store: dist.TCPStore) -> None:
        self.store = store
        self.last_beat = 0.0
        self._silent = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def beat(self) -> "Rank1":
        self._silent.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._silent.is_set():
            self.store.add("arfusion/heartbeat/1", 1)
            self.last_beat = time.monotonic()
            time.sleep(interval_s(DIST_TIMEOUT_S))

    def silence(self) -> float:
        """Stop beating; returns the time of the last beat written."""
        self._silent.set()
        self._thread.join(WAIT_S)
        return self.last_beat

    def finish(self, step: int) -> None:
        self.store.add("arfusion/step/1", step - self.store.add("arfusion/step/1", 0))


class Watched:
    """A rendezvous store, rank 0's monitor of rank 1 and its watchdog, recording the reasons."""

    def __init__(self) -> None:
        port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        self.rank1 = Rank1(self.store).beat()
        self.monitor = HeartbeatMonitor(f"tcp://127.0.0.1:{port}", [1], DIST_TIMEOUT_S)
        self.reasons: list[tuple[float, str]] = []
        self.watchdog = DistWatchdog(self.monitor, DIST_TIMEOUT_S, lambda why: self.reasons.append((time.monotonic(), why)))

    def wait_for_reason(self, timeout_s: float) -> Optional[tuple[float, str]]:
        deadline = time.monotonic() + timeout_s
        while not self.reasons and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.reasons[0] if self.reasons else None

    def close(self) -> None:
        self.watchdog.stop()
        self.rank1.silence()
        self.monitor.stop()


@pytest.fixture
def watched() -> Watched:
    watched = Watched()
    yield watched
    watched.close()


def latest_fire(since: float) -> float:
    return since + DIST_TIMEOUT_S + detection_bound_s(DIST_TIMEOUT_S) + THREAD_ALLOWANCE_S


def test_a_worker_silent_for_the_dist_timeout_fails_the_server_naming_its_rank(watched: Watched):
    time.sleep(2 * interval_s(DIST_TIMEOUT_S))  # rank 0 has seen a few beats
    last_beat = watched.rank1.silence()
    fired = watched.wait_for_reason(latest_fire(last_beat) - time.monotonic() + WAIT_S)
    assert fired is not None, "the watchdog never fired"
    at, reason = fired
    print(f"\nfired {at - last_beat:.2f} s after the last beat (--dist-timeout {DIST_TIMEOUT_S:g} s): {reason}")
    assert reason.startswith("TP worker rank 1 sent no heartbeat for ") and f"(--dist-timeout {DIST_TIMEOUT_S:g} s)" in reason
    assert last_beat + DIST_TIMEOUT_S <= at <= latest_fire(last_beat), "fired before the timeout or too late"
    assert len(watched.reasons) == 1, "fires once"


def test_a_worker_silent_for_less_than_the_dist_timeout_is_not_failed(watched: Watched):
    time.sleep(2 * interval_s(DIST_TIMEOUT_S))
    watched.rank1.silence()
    time.sleep(DIST_TIMEOUT_S / 2)  # as a SIGSTOP then SIGCONT: /health says 503 meanwhile, nothing fails
    assert watched.monitor.missed() is not None
    watched.rank1.beat()
    time.sleep(2 * DIST_TIMEOUT_S)
    assert watched.reasons == [] and watched.monitor.missed() is None


class BlockedScheduler:
    """Rank 0's scheduler over a `FakeRunner` whose ``hold_at``-th step never finishes (until
    `release`), serving one request; the watchdog of ``watched`` bounds its steps."""

    def __init__(self, watched: Watched, hold_at: int) -> None:
        self.runner = FakeRunner(hold_at=hold_at)
        self.failures: list[str] = []
        self.scheduler = Scheduler(self.runner, build_tiny_tokenizer(), max_prefill_tokens=64,
                                   on_failure=self.failures.append)
        self.chunks, emit = collect()
        self.scheduler.submit(Request([1, 2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), emit=emit))
        watched.watchdog.watch_steps(self.runner.progress)
        self.thread = threading.Thread(target=self.scheduler.run_forever, daemon=True)
        self.thread.start()

    def wait_blocked(self, step: int) -> float:
        """When the blocked step began on rank 0 (waits for it to begin)."""
        deadline = time.monotonic() + WAIT_S
        while (oldest := self.runner.progress.oldest_unfinished()) is None or oldest[0] != step:
            assert time.monotonic() < deadline, f"step {step} did not begin"
            time.sleep(0.01)
        return oldest[1]

    def release(self) -> None:
        self.scheduler.stop()
        self.runner.release.set()
        self.thread.join(WAIT_S)


@pytest.mark.parametrize("rank1_finished", [False, True], ids=["both-ranks-behind", "rank-0-behind"])
def test_a_step_in_flight_past_the_dist_timeout_while_every_worker_beats_fails_naming_the_ranks_behind(
        watched: Watched, rank1_finished: bool):
    held = 2
    blocked = BlockedScheduler(watched, held)
    try:
        began = blocked.wait_blocked(held)
        watched.rank1.finish(held if rank1_finished else held - 1)
        fired = watched.wait_for_reason(latest_fire(began) - time.monotonic() + WAIT_S)
        assert fired is not None, "the watchdog never fired"
        at, reason = fired
        print(f"\nfired {at - began:.2f} s after the step began: {reason}")
        assert reason.startswith(f"FusionTimeoutError: step {held} has been in flight for ")
        assert reason.endswith("ranks that did not finish it: " + ("0" if rank1_finished else "0, 1"))
        assert began + DIST_TIMEOUT_S <= at <= latest_fire(began), "fired before the timeout or too late"
        assert blocked.failures == [] and blocked.thread.is_alive(), "the scheduler itself is still blocked"
    finally:
        blocked.release()


def test_a_stalled_step_waits_for_the_heartbeat_rule_while_a_worker_misses_its_beats(watched: Watched):
    """A step blocked because its worker is stopped: the reason names the silent worker."""
    held = 2
    blocked = BlockedScheduler(watched, held)
    try:
        began = blocked.wait_blocked(held)
        last_beat = watched.rank1.silence()
        fired = watched.wait_for_reason(latest_fire(last_beat) - time.monotonic() + WAIT_S)
        assert fired is not None, "the watchdog never fired"
        at, reason = fired
        assert reason.startswith("TP worker rank 1 sent no heartbeat"), reason
        assert at >= max(began, last_beat) + DIST_TIMEOUT_S
    finally:
        blocked.release()
