r"""Mixed load around one long prompt: does it stall the other clients?

    python -m arfusion.benchmarks.bench_long_prompt --port 30000 --long-prompt-tokens 2000 --streams 2 \
        --stream-tokens 48 --short-delay-s 1 --output-file long_prompt.jsonl

What it does, against a running server (streamed OpenAI completions, greedy, ``ignore_eos``):

1. starts ``--streams`` running requests (a short prompt, ``--stream-tokens`` output tokens
   each) and waits until every one has streamed its first token;
2. sends the long prompt: ``--long-prompt-tokens`` token ids (seeded, drawn from
   ``[--min-token-id, --max-token-id)``), ``max_tokens`` 1;
3. ``--short-delay-s`` later, while the long prompt is being prefilled, sends a short request
   (``--short-prompt``, ``--short-max-tokens``).

It reports the short request's TTFT, the long request's latency, and the running streams'
inter-token times while the long request was in flight (the gaps between consecutive text
chunks of each stream that end inside that window): median, p90 and max. A long prompt that
stalls everyone shows as a short-request TTFT close to the long request's latency and a max
inter-token time of about the same size. A table is printed and one JSON line appended to
``--output-file``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any, Optional, Sequence

import numpy as np

from arfusion.benchmarks.client import CompletionClient, StreamedCompletion, base_url


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m arfusion.benchmarks.bench_long_prompt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the server's host (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="the server's port (default: %(default)s)")
    p.add_argument("--long-prompt-tokens", type=int, default=2000, help="token ids of the long prompt (default: %(default)s)")
    p.add_argument("--min-token-id", type=int, default=300, help="smallest id of the long prompt (default: %(default)s)")
    p.add_argument("--max-token-id", type=int, default=20000,
                   help="ids of the long prompt are below this; take it at most the vocabulary size (default: %(default)s)")
    p.add_argument("--streams", type=int, default=2, help="running streams during the long prefill (default: %(default)s)")
    p.add_argument("--stream-tokens", type=int, default=48, help="output tokens of each stream (default: %(default)s)")
    p.add_argument("--stream-prompt", default="def fib(n):", help="prompt of the streams (default: %(default)r)")
    p.add_argument("--short-prompt", default="def add(a, b):", help="the short request's prompt (default: %(default)r)")
    p.add_argument("--short-max-tokens", type=int, default=4, help="the short request's max_tokens (default: %(default)s)")
    p.add_argument("--short-delay-s", type=float, default=1.0,
                   help="seconds after sending the long prompt to send the short one (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the long prompt's ids (default: %(default)s)")
    p.add_argument("--label", default="", help="a label for the JSON line (e.g. before / after)")
    p.add_argument("--output-file", help="append the result as one JSON line (default: not written)")
    args = p.parse_args(argv)
    if args.long_prompt_tokens < 1 or args.streams < 0 or args.stream_tokens < 2 or args.short_max_tokens < 1:
        p.error("--long-prompt-tokens and --short-max-tokens must be >= 1, --streams >= 0, --stream-tokens >= 2")
    if not 0 <= args.min_token_id < args.max_token_id:
        p.error("need 0 <= --min-token-id < --max-token-id")
    return args


def gaps_within(streams: Sequence[StreamedCompletion], start: float, end: float) -> list[float]:
    """Seconds between consecutive text chunks of each stream, for the gaps that end in [start, end]."""
    gaps = []
    for s in streams:
        times = s.text_times
        gaps += [b - a for a, b in zip(times, times[1:]) if start <= b <= end]
    return gaps


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    long_prompt = [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.long_prompt_tokens)]
    greedy = {"temperature": 0, "ignore_eos": True}
    async with CompletionClient(base_url(args.host, args.port), max_concurrency=args.streams + 2) as client:
        times: list[list[float]] = [[] for _ in range(args.streams)]
        streams = [asyncio.ensure_future(client.stream(args.stream_prompt, text_times=t, max_tokens=args.stream_tokens,
                                                       **greedy)) for t in times]
        while not all(times) and not any(s.done() for s in streams):  # every stream is running
            await asyncio.sleep(0.02)
        long_start = time.perf_counter()
        long_task = asyncio.ensure_future(client.complete(long_prompt, max_tokens=1, **greedy))
        await asyncio.sleep(args.short_delay_s)
        short = await client.stream(args.short_prompt, max_tokens=args.short_max_tokens, **greedy)
        long = await long_task
        long_end = long_start + long.latency_s
        done = await asyncio.gather(*streams)
    gaps = gaps_within(done, long_start, long_end)
    return {
        "label": args.label, "long_prompt_tokens": long.prompt_tokens, "streams": args.streams,
        "long_latency_s": round(long.latency_s, 3), "short_ttft_s": round(short.ttft_s or float("nan"), 3),
        "short_latency_s": round(short.latency_s, 3),
        "stream_gaps_during_long": len(gaps),
        "itl_median_s": round(float(np.median(gaps)), 3) if gaps else None,
        "itl_p90_s": round(float(np.percentile(gaps, 90)), 3) if gaps else None,
        "itl_max_s": round(max(gaps), 3) if gaps else None,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    for key, value in result.items():
        print(f"{key:>24}  {value}")
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
