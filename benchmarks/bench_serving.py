r"""Online serving benchmark: streamed OpenAI completions at a fixed maximum concurrency.

    python -m arfusion.benchmarks.bench_serving --dataset-name random --random-input-len 512 \
        --random-output-len 1024 --random-range-ratio 1 --num-prompts 200 --max-concurrency 32 \
        --warmup-requests 10 --output-file serving.jsonl --port 30000

Lengths fit the served model: the benchmark reads its context length (``max_model_len`` of
``/v1/models``, else ``/get_server_info``); a length not given defaults to 1024 tokens, or to
a quarter of the context when that is less, and lengths given that cannot fit are refused
with the numbers to pass instead.

Prompts: text of random common English words. How many tokens a word makes depends on the
tokenizer (one in the usual BPE vocabularies, about six in a byte-level one), so two probe
requests (``max_tokens`` 1) measure it from the server's ``usage.prompt_tokens`` and each
prompt gets the number of words that makes about its length in tokens (one word per token if
the server reports no usage; the table uses the reported counts). Lengths are drawn uniformly
from ``[max(1, ratio * len), len]`` (``--random-range-ratio 1``: all the same). Every request
sends ``ignore_eos: true`` and ``max_tokens = output length`` so the output length is exact,
and ``stream_options.include_usage`` so the last chunk carries the counts.

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

from arfusion.benchmarks.client import CompletionClient, ServerError, StreamedCompletion, base_url, gather_with_progress

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


DEFAULT_LEN = 1024  # input and output tokens when not given and the context allows


@dataclass(frozen=True)
class RequestSpec:
    """One request: the prompt, its approximate token count and the exact output length."""

    prompt: str
    input_len: int
    output_len: int


@dataclass(frozen=True)
class TokenRate:
    """Prompt tokens of a text of ``n`` random words: ``fixed + per_word * n`` (fixed: BOS etc.)."""

    per_word: float = 1.0
    fixed: float = 0.0

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.fixed) / self.per_word))


def sample_lengths(rng: random.Random, length: int, range_ratio: float, count: int) -> list[int]:
    """``count`` integers uniform in ``[max(1, int(length * range_ratio)), length]``."""
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(count)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    rate: TokenRate = TokenRate()) -> list[RequestSpec]:
    """Seeded random prompts of about ``input_len`` tokens at ``rate`` (see the module docstring)."""
    rng = random.Random(seed)
    inputs = sample_lengths(rng, input_len, range_ratio, num_prompts)
    outputs = sample_lengths(rng, output_len, range_ratio, num_prompts)
    return [RequestSpec(random_text(rng, rate.words_for(n_in)), n_in, n_out) for n_in, n_out in zip(inputs, outputs)]


def random_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


async def server_limits(url: str) -> tuple[Optional[int], TokenRate]:
    """The served model's context length (None if the server does not say) and the prompt
    tokens per word, measured by two probe requests that fit that context."""
    async with CompletionClient(url) as client:
        context = await client.context_length()
        long = 32 if context is None or context >= 1024 else max(4, context // 32)
        rng = random.Random(0)
        probes = [await client.complete(random_text(rng, n), max_tokens=1, temperature=0.0) for n in (long // 4, long)]
    tokens = [p.prompt_tokens for p in probes]
    if None in tokens or tokens[1] <= tokens[0]:
        return context, TokenRate()
    per_word = (tokens[1] - tokens[0]) / (long - long // 4)
    return context, TokenRate(per_word, tokens[0] - per_word * (long // 4))


def fit_lengths(input_len: Optional[int], output_len: Optional[int], context: Optional[int]) -> tuple[int, int]:
    """(input, output) tokens: a length not given is `DEFAULT_LEN`, or a quarter of ``context``
    when that is less; SystemExit saying what to pass when the two cannot fit ``context``."""
    default = DEFAULT_LEN if context is None else max(1, min(DEFAULT_LEN, context // 4))
    fitted = (input_len or default, output_len or default)
    if context is not None and sum(fitted) > context:
        raise SystemExit(
            f"error: --random-input-len {fitted[0]} + --random-output-len {fitted[1]} = {sum(fitted)} tokens exceed the "
            f"served model's context length {context}; pass lengths that sum to at most {context}, "
            f"e.g. --random-input-len {default} --random-output-len {default}")
    return fitted


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
    p = argparse.ArgumentParser(prog="python -m arfusion.benchmarks.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    server.add_argument("--backend", choices=["openai", "sglang-oai"], default="openai",
                        help="OpenAI completions with streaming; sglang-oai: the same, so SGLang's commands run "
                             "unchanged (default: %(default)s)")
    server.add_argument("--host", default="127.0.0.1", help="the server's host (default: %(default)s)")
    server.add_argument("--port", type=int, default=30000, help="the server's port (default: %(default)s)")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=["random"], default="random",
                      help="random: prompts of random common words (default: %(default)s)")
    data.add_argument("--random-input-len", type=int, default=None,
                      help=f"prompt tokens (default: {DEFAULT_LEN}, or a quarter of the served context when less)")
    data.add_argument("--random-output-len", type=int, default=None,
                      help=f"output tokens (default: {DEFAULT_LEN}, or a quarter of the served context when less)")
    data.add_argument("--random-range-ratio", type=float, default=1.0,
                      help="lengths uniform in [ratio * len, len] (default: %(default)s: all the same)")
    data.add_argument("--seed", type=int, default=1, help="seed of the prompts and lengths (default: %(default)s)")
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100, help="measured requests (default: %(default)s)")
    load.add_argument("--max-concurrency", type=int, default=1,
                      help="most requests in flight at once (default: %(default)s)")
    load.add_argument("--warmup-requests", type=int, default=1,
                      help="requests before the measured run, not counted (default: %(default)s)")
    output = p.add_argument_group("output")
    output.add_argument("--output-file", help="append one JSON line per run (default: not written)")
    output.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    given = [n for n in (args.random_input_len, args.random_output_len) if n is not None]
    if min(*given, args.num_prompts, args.max_concurrency) < 1:
        raise SystemExit("--random-input-len, --random-output-len, --num-prompts and --max-concurrency must be >= 1")
    if not 0.0 <= args.random_range_ratio <= 1.0 or args.warmup_requests < 0:
        raise SystemExit("--random-range-ratio must be in [0, 1] and --warmup-requests >= 0")
    url = base_url(args.host, args.port)
    try:
        context, rate = asyncio.run(server_limits(url))
    except ServerError as exc:
        raise SystemExit(f"error: {exc}") from None
    input_len, output_len = fit_lengths(args.random_input_len, args.random_output_len, context)
    print(f"context length {context if context is not None else 'not reported'}; input {input_len} and output "
          f"{output_len} tokens; {rate.per_word:.2f} prompt tokens per word")
    specs = random_requests(args.num_prompts, input_len, output_len, args.random_range_ratio, args.seed, rate)
    warmup = random_requests(args.warmup_requests, input_len, min(output_len, 16), 1.0, args.seed + 1, rate)
    try:
        outcomes, duration = asyncio.run(benchmark(url, specs, warmup, args.max_concurrency,
                                                   progress=not args.no_progress))
    except ServerError as exc:
        raise SystemExit(f"error: {exc}") from None
    row = summarize(specs, outcomes, duration, args.max_concurrency)
    errors = [o for o in outcomes if isinstance(o, Exception)]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]!r}")
    print(format_table(row))
    if args.output_file:
        config = {k: getattr(args, k) for k in ("backend", "dataset_name", "random_range_ratio", "num_prompts",
                                                "warmup_requests", "seed")}
        config.update(random_input_len=input_len, random_output_len=output_len, context_length=context)
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({**config, **row}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
