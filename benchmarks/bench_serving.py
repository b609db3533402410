r"""Online serving benchmark: streamed OpenAI completions at a fixed maximum concurrency.

    python -m benchmarks.bench_serving --dataset-name random --random-input-len 512 \
        --random-output-len 1024 --random-range-ratio 1 --num-prompts 200 --max-concurrency 32 \
        --warmup-requests 10 --output-file serving.jsonl --port 30000

Prompts: text of random common English words, one word per requested input token (each
word with its leading space is one token in the usual BPE vocabularies, so the count is
approximate; the table uses the server's ``usage.prompt_tokens`` when it reports it). Lengths
are drawn uniformly from ``[max(1, ratio * len), len]`` (``--random-range-ratio 1``: exact).
Every request sends ``ignore_eos: true`` and ``max_tokens = output length`` so the output
length is exact, and ``stream_options.include_usage`` so the last chunk carries the counts.

Per request: TTFT = time to the first chunk with text; TPOT = (latency - TTFT) / (output
tokens - 1), output tokens from usage, else the number of text chunks. Per run:
input/output throughput = tokens / wall duration, per_user_throughput = output_throughput /
max_concurrency. Warm-up requests run first and are not counted. A table is printed and one
JSON line per run appended to ``--output-file``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from benchmarks.client import CompletionClient, ServerError, StreamedCompletion, base_url, gather_with_progress

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education"
).split()

COLUMNS = ("max_concurrency", "input_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
           "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "per_user_throughput")


@dataclass(frozen=True)
class RequestSpec:
    """One request: the prompt, its approximate token count and the exact output length."""

    prompt: str
    input_len: int
    output_len: int


def sample_lengths(rng: random.Random, length: int, range_ratio: float, count: int) -> list[int]:
    """``count`` integers uniform in ``[max(1, int(length * range_ratio)), length]``."""
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(count)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[RequestSpec]:
    """Seeded random prompts of word counts ~ input tokens (see the module docstring)."""
    rng = random.Random(seed)
    inputs = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outputs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    return [RequestSpec(" ".join(rng.choices(WORDS, k=n_in)), n_in, n_out) for n_in, n_out in zip(inputs, outputs)]


async def _send(client: CompletionClient, spec: RequestSpec) -> StreamedCompletion:
    return await client.stream(spec.prompt, max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)


async def _send_or_error(client: CompletionClient, spec: RequestSpec) -> StreamedCompletion | Exception:
    try:
        return await _send(client, spec)
    except Exception as exc:  # a failed request is counted, not fatal
        return exc


async def benchmark(url: str, specs: Sequence[RequestSpec], warmup: Sequence[RequestSpec], max_concurrency: int,
                    progress: bool = True) -> tuple[list[StreamedCompletion | Exception], float]:
    """Run ``warmup`` (failures raise), then ``specs``; returns each outcome and the wall duration."""
    async with CompletionClient(url, max_concurrency=max_concurrency) as client:
        if warmup:
            await asyncio.gather(*(_send(client, s) for s in warmup))
        start = time.perf_counter()
        outcomes = await gather_with_progress((_send_or_error(client, s) for s in specs), "requests", not progress)
        return outcomes, time.perf_counter() - start


def summarize(specs: Sequence[RequestSpec], outcomes: Sequence[StreamedCompletion | Exception], duration_s: float,
              max_concurrency: int) -> dict[str, Any]:
    """The columns of `COLUMNS` plus counts, over the requests that succeeded."""
    done = [(s, o) for s, o in zip(specs, outcomes) if not isinstance(o, Exception)]
    if not done:
        raise RuntimeError(f"all {len(specs)} requests failed; first error: {outcomes[0]!r}")
    in_tokens = [o.prompt_tokens if o.prompt_tokens is not None else s.input_len for s, o in done]
    out_tokens = [o.completion_tokens if o.completion_tokens is not None else o.text_chunks for _, o in done]
    ttfts = [1000 * o.ttft_s for _, o in done if o.ttft_s is not None]
    tpots = [1000 * (o.latency_s - o.ttft_s) / (n - 1) for (_, o), n in zip(done, out_tokens) if o.ttft_s is not None and n > 1]
    output_throughput = sum(out_tokens) / duration_s
    return {
        "max_concurrency": max_concurrency,
        "input_throughput": sum(in_tokens) / duration_s,
        "output_throughput": output_throughput,
        **_stats("ttft_ms", ttfts),
        **_stats("tpot_ms", tpots),
        "per_user_throughput": output_throughput / max_concurrency,
        "completed": len(done),
        "failed": len(specs) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": sum(in_tokens),
        "total_output_tokens": sum(out_tokens),
        "mean_e2e_latency_ms": 1000 * float(np.mean([o.latency_s for _, o in done])),
    }


def _stats(name: str, values: Sequence[float]) -> dict[str, Optional[float]]:
    if not values:
        return {f"mean_{name}": None, f"median_{name}": None, f"p99_{name}": None}
    return {f"mean_{name}": float(np.mean(values)), f"median_{name}": float(np.median(values)),
            f"p99_{name}": float(np.percentile(values, 99))}


def format_table(row: dict[str, Any]) -> str:
    """Header and one row of `COLUMNS`, right aligned, three decimals."""
    cells = ["n/a" if row[c] is None else (str(row[c]) if isinstance(row[c], int) else f"{row[c]:.3f}") for c in COLUMNS]
    widths = [max(len(c), len(v)) for c, v in zip(COLUMNS, cells)]
    return "\n".join(["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)),
                      "  ".join(v.rjust(w) for v, w in zip(cells, widths))])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["openai", "sglang-oai"], default="openai",
                   help="OpenAI completions with streaming (sglang-oai: the same, so SGLang's commands run unchanged)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [ratio*len, len]")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1, help="requests before the measured run, not counted")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", help="append one JSON line per run")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.random_input_len, args.random_output_len, args.num_prompts, args.max_concurrency) < 1:
        raise SystemExit("--random-input-len, --random-output-len, --num-prompts and --max-concurrency must be >= 1")
    if not 0.0 <= args.random_range_ratio <= 1.0 or args.warmup_requests < 0:
        raise SystemExit("--random-range-ratio must be in [0, 1] and --warmup-requests >= 0")
    specs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed)
    warmup = random_requests(args.warmup_requests, args.random_input_len, min(args.random_output_len, 16), 1.0, args.seed + 1)
    try:
        outcomes, duration = asyncio.run(benchmark(base_url(args.host, args.port), specs, warmup, args.max_concurrency,
                                                   progress=not args.no_progress))
    except ServerError as exc:
        raise SystemExit(f"error: {exc}") from None
    row = summarize(specs, outcomes, duration, args.max_concurrency)
    errors = [o for o in outcomes if isinstance(o, Exception)]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]!r}")
    print(format_table(row))
    if args.output_file:
        config = {k: getattr(args, k) for k in ("backend", "dataset_name", "random_input_len", "random_output_len",
                                                "random_range_ratio", "num_prompts", "warmup_requests", "seed")}
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({**config, **row}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
