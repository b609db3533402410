"""An asyncio HTTP client for tests that put load on a real server (loopback only): each request's
outcome is kept whatever happens to it, so a test can assert on what every client received.

`Outcome` holds the HTTP status and the JSON body, or for a stream the SSE events (parsed JSON,
and "[DONE]") with their arrival times, or the connection error. `in_background` runs a coroutine on its own event loop
in a thread, so a test can signal or kill the server meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import aiohttp


@dataclass
class Outcome:
    status: Optional[int] = None
    body: Any = None  # the JSON body of a non-streaming answer (or of a refused stream)
    events: list[Any] = field(default_factory=list)  # a stream's events: JSON objects, then "[DONE]"
    error: Optional[str] = None  # the connection broke (repr of the exception)
    event_times: list[float] = field(default_factory=list)  # time.monotonic() of each event's arrival
    finished_at: Optional[float] = None  # time.monotonic() when the answer was complete or broke

    def error_object(self) -> Optional[dict[str, Any]]:
        """The ``error`` object of the JSON body or of the stream's error event, if any."""
        if isinstance(self.body, dict) and "error" in self.body:
            return self.body["error"]
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               first_event: Optional[asyncio.Event] = None, events_wanted: Optional[int] = None,
               outcome: Optional[Outcome] = None) -> Outcome:
    """POST ``body`` as JSON and read the whole answer; ``first_event`` is set when a stream's
    first event arrives; with ``events_wanted`` the client disconnects after that many events.
    Fills and returns ``outcome`` (a new one if None: pass one to watch a stream as it goes)."""
    outcome = Outcome() if outcome is None else outcome
    try:
        return await _read(session, url, body, first_event, events_wanted, outcome)
    finally:
        outcome.finished_at = time.monotonic()


async def _read(session: aiohttp.ClientSession, url: str, body: dict[str, Any], first_event: Optional[asyncio.Event],
                events_wanted: Optional[int], outcome: Outcome) -> Outcome:
    try:
        async with session.post(url, json=body) as resp:
            outcome.status = resp.status
            if not (body.get("stream") and resp.status == 200):
                outcome.body = json.loads(await resp.read())
                return outcome
            async for line in resp.content:
                text = line.decode().strip()
                if text.startswith("data: "):
                    data = text[len("data: "):]
                    outcome.events.append(data if data == "[DONE]" else json.loads(data))
                    outcome.event_times.append(time.monotonic())
                    if first_event is not None:
                        first_event.set()
                    if len(outcome.events) == events_wanted:
                        resp.close()
                        return outcome
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        outcome.error = repr(exc)
    return outcome


def in_background(make: Callable[[], Awaitable[Any]]) -> Callable[[float], Any]:
    """Run ``make()`` on a new event loop in a thread; returns ``result(timeout_s)``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = asyncio.run(make())
        except BaseException as exc:  # handed to the test thread by result()
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout_s: float) -> Any:
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"the clients did not finish within {timeout_s} s")
        if "error" in box:
            raise box["error"]
        return box["result"]

    return result
