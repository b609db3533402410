"""Does a request with a flood of stop strings slow down other clients' streams?

    python -m arfusion.benchmarks.bench_stop_strings [--tokens 200] [--repeats 3] [--only KEY ...] [-- server flags]

Starts a server (default: the built-in tiny model) on loopback and measures one client's
streamed tokens per second (a greedy stream of ``--tokens`` tokens, ``ignore_eos``) alone and
while other clients send the requests of each scenario (its key in brackets):

    flood: two clients send the request back to back while the victim streams
      (long-control)     a 400-token stream without stop strings: what two other streams cost anyway
      (largest)          the same stream with 64 stop strings of 1024 random characters (served)
      (short-control)    a 1-token stream without stop strings: what a flood of short requests costs anyway
      (largest-short)    the same with the largest list: an automaton to make for every request
      (refused-control)  a small body refused with 400 (65 one-character stop strings): what a flood
                         of refusals costs anyway
      (stops-flood)      40,000 stop strings (549 KB, refused: 400)
      (chars-flood)      one stop string of 500,000 characters (refused: 400)
    once: the requests are sent once each, half a second into the victim's stream
      (stops-once)       two requests of 40,000 stop strings
      (chars-once)       one request with a stop string of 500,000 characters

Each body is encoded once, so that the clients' own JSON encoding takes no CPU from the server's
while they send. The scenarios take turns, ``--repeats`` rounds (``--only``: those keys, and
``alone``). Prints a table of the victim's median tokens/s per scenario, its ratio to the median
alone, and, where a scenario has a control, the median over the rounds of its ratio to that
control in the same round, with its range: for a served stop list, the same number of the same
requests without stop strings (the two others' decode steps share the batch in both), so that
the ratio is what the stop strings cost; for a flood of refused large bodies, the same flood of
small refused bodies, so that the ratio is what their size costs; for the requests sent once,
the victim alone. On a loaded machine the end-to-end rates are noisy, so it also measures what
a stop list costs the thread that runs every request: the median time of one `Request.release`
(one token's detokenization and stop-string check) of a request with each list, and the time to
make its stop-string automaton (a list the server refuses is constructed directly where the
checkout allows it, else reported refused). For the requests a flood sends (`CPU_KEYS`), it
then sends each ``--cpu-requests`` times from one client, nothing else running, and reports the
CPU time per request of the server's process and of its child processes (the body parsers at
TP1), from /proc. The tables go to ``--out`` as JSON. Run it in another checkout
(``PYTHONPATH=that/checkout``) for that code's numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp

from arfusion.benchmarks.local_server import start_server

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.request import Request
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer

ONCE_DELAY_S = 0.5  # when the requests sent once go, after the victim's stream began
CPU_KEYS = ("refused-control", "stops-flood", "chars-flood", "largest-short")


def stop_lists(seed: int) -> dict[str, list[str]]:
    """The abusive stop lists by name (the largest the server allows: 64 x 1024)."""
    rng = random.Random(seed)
    chars = [chr(c) for c in range(33, 127)]
    return {
        "largest allowed (64 x 1024 chars)": ["".join(rng.choice(chars) for _ in range(1024)) for _ in range(64)],
        "40,000 stops": [f"stop {i}" for i in range(40_000)],
        "500,000 chars": ["x" * 500_000],
    }


@dataclass(frozen=True)
class Scenario:
    """``clients`` others send ``body`` (None: nobody sends) back to back (``flood``) or once
    each, ``ONCE_DELAY_S`` into the victim's stream; ``control``: the key of the scenario its
    ratio is taken against."""

    name: str
    body: Optional[bytes]
    clients: int = 2
    flood: bool = True
    control: Optional[str] = None


def scenarios(seed: int) -> dict[str, Scenario]:
    """Every scenario by key, in the order they take turns."""
    base = {"prompt": "The stop strings are many", "max_tokens": 400, "ignore_eos": True, "stream": True}
    lists = stop_lists(seed)
    largest, stops, chars = (lists[name] for name in ("largest allowed (64 x 1024 chars)", "40,000 stops",
                                                      "500,000 chars"))

    def body(**fields: Any) -> bytes:
        return json.dumps({**base, **fields}).encode()

    return {
        "alone": Scenario("alone", None, clients=0),
        "long-control": Scenario("2 streams, no stop strings (control)", body()),
        "largest": Scenario("largest allowed (64 x 1024 chars)", body(stop=largest), control="long-control"),
        "short-control": Scenario("1-token requests, no stops (control)", body(max_tokens=1)),
        "largest-short": Scenario("largest, 1-token requests", body(max_tokens=1, stop=largest),
                                  control="short-control"),
        "refused-control": Scenario("65 stops, 400 (control)", body(stop=["s"] * 65)),
        "stops-flood": Scenario("40,000 stops, flood (400)", body(stop=stops), control="refused-control"),
        "chars-flood": Scenario("500,000 chars, flood (400)", body(stop=chars), control="refused-control"),
        "stops-once": Scenario("2 x 40,000 stops, once (400)", body(stop=stops), flood=False, control="alone"),
        "chars-once": Scenario("1 x 500,000 chars, once (400)", body(stop=chars), clients=1, flood=False,
                               control="alone"),
    }


def build_cost_us(stops: list[str]) -> Optional[float]:
    """Median microseconds (of 5) to make the stop-string automaton of a request with ``stops``
    (`SamplingParams.stop_strings`); None when the params are refused."""
    times = []
    for _ in range(5):
        try:
            params = SamplingParams(max_tokens=1, stop=tuple(stops))
        except ValueError:
            return None
        start = time.perf_counter()
        params.stop_strings
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def release_cost_us(stops: list[str], tokens: int = 400) -> Optional[float]:
    """Median microseconds of one `Request.release` over ``tokens`` random byte tokens of a
    request with ``stops`` (none matches: bytes 0x80-0xff); None when the params are refused."""
    try:
        params = SamplingParams(max_tokens=tokens, stop=tuple(stops))
    except ValueError:
        return None
    tokenizer = build_tiny_tokenizer()
    rng = random.Random(1)
    req = Request([1, 2], params, emit=lambda chunk: None)
    times = []
    for _ in range(tokens):
        req.output_ids.append(rng.randrange(0x80, 0x100))
        start = time.perf_counter()
        req.release(tokenizer)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


async def stream_rate(session: aiohttp.ClientSession, url: str, tokens: int, began: asyncio.Event) -> float:
    """Tokens per second of one greedy stream, from its first event to its last; ``began`` is
    set at its first event."""
    body = {"prompt": "Hello there", "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    times = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
                began.set()
    return (len(times) - 1) / (times[-1] - times[0])


async def send(session: aiohttp.ClientSession, url: str, body: bytes, stop: asyncio.Event) -> None:
    """POST ``body`` (JSON) and read the answer, up to its end or ``stop``."""
    async with session.post(url + "/v1/completions", data=body, headers={"content-type": "application/json"}) as resp:
        async for _ in resp.content:
            if stop.is_set():
                break


async def abuse(session: aiohttp.ClientSession, url: str, case: Scenario, began: asyncio.Event,
                stop: asyncio.Event) -> int:
    """Send ``case.body`` back to back until ``stop`` (a flood), or once ``ONCE_DELAY_S`` after
    ``began``; returns how many were sent."""
    assert case.body is not None
    if not case.flood:
        await began.wait()
        await asyncio.sleep(ONCE_DELAY_S)
        await send(session, url, case.body, stop)
        return 1
    sent = 0
    while not stop.is_set():
        await send(session, url, case.body, stop)
        sent += 1
    return sent


async def run_scenario(url: str, case: Scenario, tokens: int) -> tuple[float, int]:
    """The victim's tokens/s while ``case``'s clients send, and how many requests they sent."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        stop, began = asyncio.Event(), asyncio.Event()
        abusers = [asyncio.ensure_future(abuse(session, url, case, began, stop)) for _ in range(case.clients)]
        if case.flood and case.clients:
            await asyncio.sleep(1.0)  # the flood is running
        rate = await stream_rate(session, url, tokens, began)
        stop.set()
        return rate, sum(await asyncio.gather(*abusers))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=200, help="tokens of the measured stream (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per scenario, median taken (default: %(default)s)")
    p.add_argument("--out", default="bench_stop_strings.json", help="result file (default: %(default)s)")
    p.add_argument("--release-only", action="store_true", help="only the Request.release table (no server)")
    p.add_argument("--cpu-requests", type=int, default=100,
                   help="requests per row of the CPU table (0: no CPU table; default: %(default)s)")
    p.add_argument("--only", nargs="+", choices=list(scenarios(0)), default=[],
                   help="only these scenarios (with alone and their controls)")
    p.add_argument("server_flags", nargs="*", help="flags for engine.launch_server (after --)")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rows, cpu = serving_rows(url, port, args) if not args.release_only else ([], [])
    lists = {"no stop strings": []} | stop_lists(0)
    costs = {name: release_cost_us(stops) for name, stops in lists.items()}
    builds = {name: build_cost_us(stops) for name, stops in lists.items()}
    print(f"\n{'stop list':36} {'one release, us':>16} {'automaton, us':>14}")
    for name, cost in costs.items():
        print(f"{name:36} {'refused' if cost is None else f'{cost:.1f}':>16} "
              f"{'refused' if builds[name] is None else f'{builds[name]:.1f}':>14}")
    Path(args.out).write_text(json.dumps({"tokens": args.tokens, "repeats": args.repeats,
                                          "server_flags": args.server_flags,
                                          "rows": rows, "cpu_per_request": cpu,
                                          "release_us": costs, "automaton_us": builds}, indent=2) + "\n")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def send_sequentially(url: str, body: bytes, count: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(count):
            await send(session, url, body, asyncio.Event())


def cpu_rows(url: str, pid: int, count: int) -> list[dict[str, Any]]:
    """CPU milliseconds per request of the server's process ``pid`` and of its children, for
    ``count`` of each `CPU_KEYS` request sent one after the other (printed as a table)."""
    every, children = scenarios(0), child_pids(pid)
    rows = []
    for key in CPU_KEYS:
        body = every[key].body
        assert body is not None
        asyncio.run(send_sequentially(url, body, 5))  # warm up
        server, others, start = cpu_seconds(pid), sum(map(cpu_seconds, children)), time.monotonic()
        asyncio.run(send_sequentially(url, body, count))
        rows.append({"key": key, "scenario": every[key].name, "requests": count,
                     "server_cpu_ms": round(1e3 * (cpu_seconds(pid) - server) / count, 2),
                     "children_cpu_ms": round(1e3 * (sum(map(cpu_seconds, children)) - others) / count, 2),
                     "wall_ms": round(1e3 * (time.monotonic() - start) / count, 2)})
    print(f"\n{'one client sends, one at a time':38} {'server CPU ms':>14} {'children CPU ms':>16} {'wall ms':>8}")
    for row in rows:
        print(f"{row['scenario']:38} {row['server_cpu_ms']:14.2f} {row['children_cpu_ms']:16.2f} {row['wall_ms']:8.2f}")
    return rows


def serving_rows(url: str, port: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The victim's rates per scenario and the CPU table (`cpu_rows`), each printed as a table."""
    every = scenarios(0)
    keys = [k for k in every if k == "alone" or not args.only or k in args.only
            or any(every[o].control == k for o in args.only)]
    proc = start_server(port, args.server_flags)
    try:
        asyncio.run(run_scenario(url, every["alone"], 16))  # warm up
        rates: dict[str, list[float]] = {k: [] for k in keys}
        sent: dict[str, int] = {k: 0 for k in keys}
        for _ in range(args.repeats):
            for k in keys:  # the scenarios take turns: a change of the machine's load hits all
                rate, n = asyncio.run(run_scenario(url, every[k], args.tokens))
                rates[k].append(rate)
                sent[k] += n
        cpu = cpu_rows(url, proc.pid, args.cpu_requests) if args.cpu_requests else []
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    median = {k: statistics.median(r) for k, r in rates.items()}
    rows = []
    for k, r in rates.items():
        control = every[k].control
        ratios = [x / c for x, c in zip(r, rates[control])] if control else []
        rows.append({"key": k, "scenario": every[k].name, "victim_tokens_per_s": round(median[k], 2),
                     "ratio": round(median[k] / median["alone"], 3), "control": control,
                     "vs_control": round(statistics.median(ratios), 3) if ratios else None,
                     "vs_control_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
                     "runs": [round(x, 2) for x in r], "abusive_requests_sent": sent[k]})
    print(f"{'scenario':38} {'victim tok/s':>12} {'vs alone':>9} {'vs control (range)':>22} {'others sent':>12}")
    for row in rows:
        vs_control = (f"{row['vs_control']:.3f} ({row['vs_control_range'][0]:.2f}-{row['vs_control_range'][1]:.2f})"
                      if row["vs_control"] is not None else "")
        print(f"{row['scenario']:38} {row['victim_tokens_per_s']:12.1f} {row['ratio']:9.3f} {vs_control:>22} "
              f"{row['abusive_requests_sent']:12d}")
    return rows, cpu


if __name__ == "__main__":
    main()
