"""`Engine` (the asyncio side of the scheduler) with a stub scheduler: errors become
`EngineError` with the right status, `fail_all` ends every request in flight from another
thread and refuses later ones, and a delivery after the event loop closed is dropped."""
import asyncio
import threading
from typing import Callable, Optional

import pytest

from arfusion.engine.common.generation import EngineError, GenerationChunk
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.request import Request
from arfusion.engine.server.engine import Engine
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer

pytestmark = pytest.mark.timeout(30)


def no_fusion() -> None:
    """Stands for the call that clears the fusion op's decision cache, unused here."""


class StubScheduler:
    """Keeps submitted requests (``refuse``: the exception `submit` raises) and aborted ids."""

    def __init__(self, refuse: Optional[Exception] = None) -> None:
        self.alive = True
        self.refuse = refuse
        self.submitted: list[Request] = []
        self.aborted: list[int] = []

    def submit(self, req: Request) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(req)

    def abort(self, rid: int) -> None:
        self.aborted.append(rid)


def engine_with(scheduler: StubScheduler) -> Engine:
    return Engine(scheduler, build_tiny_tokenizer(), "m", 64, no_fusion, info=dict)


async def first_outcome(engine: Engine, before_wait: Callable[[], None] = lambda: None) -> object:
    """The first chunk of a request, or the exception it raised."""
    chunks = engine.generate([1, 2], SamplingParams(max_tokens=4))
    task = asyncio.ensure_future(chunks.__anext__())
    await asyncio.sleep(0.01)
    before_wait()
    try:
        return await asyncio.wait_for(task, 5)
    except Exception as exc:
        return exc
    finally:
        await chunks.aclose()


@pytest.mark.parametrize("refuse, status", [(ValueError("needs 9000 KV slots"), 400),
                                            (RuntimeError("the scheduler has stopped"), 503)])
def test_submit_errors_become_engine_errors(refuse: Exception, status: int) -> None:
    outcome = asyncio.run(first_outcome(engine_with(StubScheduler(refuse))))
    assert isinstance(outcome, EngineError) and outcome.status == status and str(refuse) in outcome.message


def test_fail_all_ends_every_request_from_another_thread_and_refuses_later_ones() -> None:
    scheduler = StubScheduler()
    engine = engine_with(scheduler)
    error = EngineError(500, "TP worker rank 1 exited (code -9)")

    async def scenario() -> list[object]:
        waiting = [asyncio.ensure_future(first_outcome(engine)) for _ in range(3)]
        await asyncio.sleep(0.05)
        ended = await asyncio.to_thread(engine.fail_all, error)
        assert ended == 3
        return [*await asyncio.gather(*waiting), await first_outcome(engine)]

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, EngineError) and (o.status, o.message) == (500, error.message) for o in outcomes)
    assert sorted(scheduler.aborted) == sorted(r.rid for r in scheduler.submitted), "each request is aborted"
    assert len(scheduler.submitted) == 3, "the refused request never reaches the scheduler"
    assert not engine.is_healthy()


def test_chunks_arrive_and_a_finished_request_is_not_aborted() -> None:
    scheduler = StubScheduler()
    engine = engine_with(scheduler)

    async def scenario() -> list[GenerationChunk]:
        chunks = engine.generate([1, 2], SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.01)
        req = scheduler.submitted[0]
        threading.Thread(target=lambda: [req.emit(GenerationChunk("a", [97], 2, 1)),
                                         req.emit(GenerationChunk("b", [98], 2, 2, "length"))]).start()
        return [await first] + [c async for c in chunks]

    assert [c.text for c in asyncio.run(scenario())] == ["a", "b"]
    assert scheduler.aborted == []


def test_a_delivery_after_the_loop_closed_is_dropped() -> None:
    scheduler = StubScheduler()
    engine = engine_with(scheduler)

    async def submit_and_leave() -> None:
        chunks = engine.generate([1], SamplingParams(max_tokens=2))
        task = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(submit_and_leave())
    scheduler.submitted[0].emit(GenerationChunk("late", [1], 1, 1))  # the scheduler thread must not see an error
    assert engine.fail_all(EngineError(503, "shutting down")) == 0


MISSED = "TP worker rank 1 missed its heartbeat: none for 5.2 s (one is due every 1.0 s)"


@pytest.mark.parametrize("scheduler_alive, workers_alive, heartbeat, healthy, problem", [
    (True, True, None, True, None),
    (True, True, MISSED, True, MISSED),  # still takes requests: the worker may come back
    (True, False, MISSED, False, "a TP worker has exited"),
    (False, True, None, False, "the scheduler has stopped"),
])
def test_health_problem_names_a_missed_heartbeat_and_every_failure(scheduler_alive, workers_alive, heartbeat,
                                                                    healthy, problem):
    scheduler = StubScheduler()
    scheduler.alive, scheduler.failure = scheduler_alive, None
    engine = Engine(scheduler, build_tiny_tokenizer(), "m", 64, no_fusion, info=dict,
                    workers_alive=lambda: workers_alive, heartbeat_missed=lambda: heartbeat)
    assert engine.is_healthy() is healthy and engine.health_problem() == problem
