"""Memory soak: a real server under a bounded mix of requests for a fixed time, its resident
memory (RSS, of the server process and of its TP workers) sampled throughout.

    python -m arfusion.benchmarks.soak_memory --minutes 60 --out soak.jsonl [-- --tp-size 2 ...server flags]

Loopback only. ``--clients`` loops each send one request at a time, cycling through: a
completion, a streamed chat, a stream the client leaves after two events, a completion with stop
strings, a /tokenize, and a refused request (400). Every ``--sample-s`` seconds a line
``{"t_s", "rss_mib": {pid: MiB}, "requests", "errors"}`` is appended to ``--out``. At the end it
prints the RSS after the first ``--warm-minutes``, at the end, and the least-squares slope (MiB
per hour) over the samples after the warm-up: a flat process has a slope near 0 and no trend.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp

from arfusion.benchmarks.local_server import start_server



def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (VmRSS), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, p in parents.items() if p in frontier]
        tree += frontier
    return tree


def slope_mib_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per hour."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 3600 * sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


def request_mix(rng: random.Random) -> list[tuple[str, dict[str, Any], int]]:
    """One round of (path, body, events to read before leaving; 0: read it all)."""
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "héllo", "world"]) for _ in range(rng.randint(5, 60)))
    return [
        ("/v1/completions", {"prompt": words, "max_tokens": 16, "temperature": 0.7, "seed": rng.randint(0, 99)}, 0),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}], "max_tokens": 16,
                                  "stream": True}, 0),
        ("/v1/completions", {"prompt": words, "max_tokens": 64, "stream": True}, 2),
        ("/v1/completions", {"prompt": words, "max_tokens": 24, "stop": ["ab", "zz", "\n\n", "the end"]}, 0),
        ("/tokenize", {"prompt": words}, 0),
        ("/v1/completions", {"prompt": words, "max_tokens": 8, "temperature": -1}, 0),
    ]


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], leave_after: int) -> bool:
    """Send one request; True when it was answered as intended (the refused one: 400)."""
    async with session.post(url, json=body) as resp:
        if not body.get("stream"):
            await resp.read()
            return resp.status == (400 if body.get("temperature", 0) < 0 else 200)
        events = 0
        async for line in resp.content:
            if line.startswith(b"data:"):
                events += 1
                if leave_after and events >= leave_after:
                    return True  # leaving the block closes the connection mid-stream
        return resp.status == 200


async def client_loop(base: str, seed: int, deadline: float, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    while time.monotonic() < deadline:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for path, body, leave_after in request_mix(rng):
                try:
                    ok = await one(session, base + path, body, leave_after)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                counts["requests"] += 1
                counts["errors"] += not ok


async def sample_loop(pid: int, deadline: float, every_s: float, out: Path, counts: dict[str, int],
                      samples: list[tuple[float, float]]) -> None:
    start = time.monotonic()
    with out.open("w") as f:
        while time.monotonic() < deadline:
            rss = {p: round(rss_mib(p), 2) for p in process_tree(pid)}
            t = time.monotonic() - start
            samples.append((t, sum(rss.values())))
            f.write(json.dumps({"t_s": round(t, 1), "rss_mib": rss, **counts}) + "\n")
            f.flush()
            await asyncio.sleep(every_s)


async def soak(args: argparse.Namespace, pid: int, port: int) -> list[tuple[float, float]]:
    deadline = time.monotonic() + 60 * args.minutes
    counts = {"requests": 0, "errors": 0}
    samples: list[tuple[float, float]] = []
    base = f"http://127.0.0.1:{port}"
    await asyncio.gather(sample_loop(pid, deadline, args.sample_s, Path(args.out), counts, samples),
                         *(client_loop(base, seed, deadline, counts) for seed in range(args.clients)))
    print(f"requests {counts['requests']}, not answered as intended {counts['errors']}")
    return samples


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="soak duration (default: %(default)s)")
    p.add_argument("--warm-minutes", type=float, default=1.0, help="samples before this are not in the slope (default: %(default)s)")
    p.add_argument("--clients", type=int, default=4, help="concurrent client loops (default: %(default)s)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples (default: %(default)s)")
    p.add_argument("--out", default="soak_memory.jsonl", help="RSS samples, one JSON line each (default: %(default)s)")
    p.add_argument("server_flags", nargs="*", help="flags for engine.launch_server (after --)")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(port, args.server_flags, env={"OMP_NUM_THREADS": "1"})
    try:
        samples = asyncio.run(soak(args, proc.pid, port))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    warm = [(t, v) for t, v in samples if t >= 60 * args.warm_minutes]
    if warm:
        half = [(t, v) for t, v in warm if t >= (warm[0][0] + warm[-1][0]) / 2]
        print(f"RSS after {args.warm_minutes:g} min {warm[0][1]:.1f} MiB, at the end ({samples[-1][0] / 60:.1f} min) "
              f"{samples[-1][1]:.1f} MiB, peak {max(v for _, v in warm):.1f} MiB; slope after the warm-up "
              f"{slope_mib_per_hour(warm):+.1f} MiB/h, over the second half {slope_mib_per_hour(half):+.1f} MiB/h")


if __name__ == "__main__":
    main()
