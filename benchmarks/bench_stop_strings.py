"""Does a request with a flood of stop strings slow down other clients' streams?

    python -m arfusion.benchmarks.bench_stop_strings [--tokens 200] [--repeats 3] [-- server flags]

Starts a server (default: the built-in tiny model) on loopback and measures one client's
streamed tokens per second (a greedy stream of ``--tokens`` tokens, ``ignore_eos``) alone and
while two other clients send, back to back, each of these requests:

    (control)            a 400-token stream without stop strings: what two other streams cost anyway
    largest allowed      the same stream with 64 stop strings of 1024 random characters (served)
    1 token (control)    a 1-token stream without stop strings: what a flood of short requests costs anyway
    largest, 1 token     the same with the largest list: an automaton to make for every request
    40,000 stops         40,000 stop strings (refused: 400)
    500,000 chars        one stop string of 500,000 characters (refused: 400)

The scenarios take turns, ``--repeats`` rounds. Prints a table of the victim's median tokens/s
per scenario, its ratio to the median alone, and, for a served stop list, to its control: the
victim among the same number of the same requests without stop strings, so that the ratio is
what the stop strings cost (the two others' decode steps share the batch in both). On a loaded
machine the end-to-end rates are noisy, so it also measures what a stop list costs the thread
that runs every request: the median time of one `Request.release` (one token's detokenization
and stop-string check) of a request with each list, and the time to make its stop-string
automaton (a list the server refuses is constructed directly where the checkout allows it, else
reported refused). Both tables go to ``--out`` as JSON. Run it in another checkout
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
from pathlib import Path
from typing import Any, Optional

import aiohttp

from arfusion.benchmarks.local_server import start_server

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.request import Request
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer



def stop_lists(seed: int) -> dict[str, list[str]]:
    """The abusive stop lists by scenario name (the largest the server allows: 64 x 1024)."""
    rng = random.Random(seed)
    chars = [chr(c) for c in range(33, 127)]
    return {
        "largest allowed (64 x 1024 chars)": ["".join(rng.choice(chars) for _ in range(1024)) for _ in range(64)],
        "40,000 stops": [f"stop {i}" for i in range(40_000)],
        "500,000 chars": ["x" * 500_000],
    }


LONG_CONTROL, SHORT_CONTROL = "2 streams, no stop strings (control)", "1-token requests, no stops (control)"
CONTROLS = {"largest allowed (64 x 1024 chars)": LONG_CONTROL, "largest, 1-token requests": SHORT_CONTROL}


def abusive_bodies(seed: int) -> dict[str, Optional[dict[str, Any]]]:
    base = {"prompt": "The stop strings are many", "max_tokens": 400, "ignore_eos": True, "stream": True}
    lists = stop_lists(seed)
    largest = lists["largest allowed (64 x 1024 chars)"]
    return {"alone": None, LONG_CONTROL: base, SHORT_CONTROL: {**base, "max_tokens": 1},
            **{name: {**base, "stop": stops} for name, stops in lists.items()},
            "largest, 1-token requests": {**base, "max_tokens": 1, "stop": largest}}


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


async def stream_rate(session: aiohttp.ClientSession, url: str, tokens: int) -> float:
    """Tokens per second of one greedy stream, from its first event to its last."""
    body = {"prompt": "Hello there", "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    times = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.monotonic())
    return (len(times) - 1) / (times[-1] - times[0])


async def abuse(session: aiohttp.ClientSession, url: str, body: dict[str, Any], stop: asyncio.Event) -> int:
    """Send ``body`` back to back until ``stop``; returns how many were sent."""
    sent = 0
    while not stop.is_set():
        async with session.post(url + "/v1/completions", json=body) as resp:
            async for _ in resp.content:
                if stop.is_set():
                    break
        sent += 1
    return sent


async def scenario(url: str, body: Optional[dict[str, Any]], tokens: int) -> tuple[float, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        stop = asyncio.Event()
        abusers = [asyncio.ensure_future(abuse(session, url, body, stop)) for _ in range(2 if body else 0)]
        await asyncio.sleep(1.0 if body else 0)  # the abusive requests are running
        rate = await stream_rate(session, url, tokens)
        stop.set()
        return rate, sum(await asyncio.gather(*abusers))


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=200, help="tokens of the measured stream (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per scenario, median taken (default: %(default)s)")
    p.add_argument("--out", default="bench_stop_strings.json", help="result file (default: %(default)s)")
    p.add_argument("--release-only", action="store_true", help="only the Request.release table (no server)")
    p.add_argument("server_flags", nargs="*", help="flags for engine.launch_server (after --)")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rows = serving_rows(url, port, args) if not args.release_only else []
    lists = {"no stop strings": []} | stop_lists(0)
    costs = {name: release_cost_us(stops) for name, stops in lists.items()}
    builds = {name: build_cost_us(stops) for name, stops in lists.items()}
    print(f"\n{'stop list':36} {'one release, us':>16} {'automaton, us':>14}")
    for name, cost in costs.items():
        print(f"{name:36} {'refused' if cost is None else f'{cost:.1f}':>16} "
              f"{'refused' if builds[name] is None else f'{builds[name]:.1f}':>14}")
    Path(args.out).write_text(json.dumps({"tokens": args.tokens, "repeats": args.repeats, "server_flags": args.server_flags,
                                          "rows": rows, "release_us": costs, "automaton_us": builds}, indent=2) + "\n")


def serving_rows(url: str, port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The victim's rates per scenario (printed as a table)."""
    proc = start_server(port, args.server_flags)
    try:
        bodies = abusive_bodies(0)
        asyncio.run(scenario(url, None, 16))  # warm up
        rates: dict[str, list[float]] = {name: [] for name in bodies}
        sent: dict[str, int] = {name: 0 for name in bodies}
        for _ in range(args.repeats):
            for name in bodies:  # the scenarios take turns: a change of the machine's load hits all
                rate, n = asyncio.run(scenario(url, bodies[name], args.tokens))
                rates[name].append(rate)
                sent[name] += n
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    median = {name: statistics.median(r) for name, r in rates.items()}
    rows = [{"scenario": name, "victim_tokens_per_s": round(median[name], 2), "ratio": round(median[name] / median["alone"], 3),
             "vs_control": round(median[name] / median[CONTROLS[name]], 3) if name in CONTROLS else None,
             "runs": [round(x, 2) for x in r], "abusive_requests_sent": sent[name]} for name, r in rates.items()]
    print(f"{'scenario':38} {'victim tok/s':>12} {'vs alone':>9} {'vs control':>11} {'others sent':>12}")
    for row in rows:
        vs_control = f"{row['vs_control']:.3f}" if row["vs_control"] is not None else ""
        print(f"{row['scenario']:38} {row['victim_tokens_per_s']:12.1f} {row['ratio']:9.3f} {vs_control:>11} "
              f"{row['abusive_requests_sent']:12d}")
    return rows


if __name__ == "__main__":
    main()
