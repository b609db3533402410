"""GSM8K few-shot chain-of-thought accuracy against an OpenAI-compatible server.

    python -m arfusion.benchmarks.gsm8k --data-path grade_school_math/data/test.jsonl --port 30000

Data: JSON lines with ``question`` and ``answer`` (the reference ends with ``#### <n>``).
``--data-path`` is the test file; the shots come from ``--train-path``, by default
``train.jsonl`` next to the test file. With neither flag the two public files of
openai/grade-school-math are downloaded (urllib) into ``~/.cache/arfusion/gsm8k``; without
network, pass ``--data-path`` (the official files: ``grade_school_math/data/{test,train}.jsonl``
of github.com/openai/grade-school-math).

The first ``--num-shots`` train rows are the shots, the first ``--num-questions`` test rows (all
by default) the questions; greedy decoding (``--temperature 0``) with stop sequences ``scoring.STOP``.
Prints accuracy, the invalid fraction (no number in the generation), wall latency and output
throughput (completion tokens from the server's usage / latency); ``--result-file`` appends
one JSON line per run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from arfusion.benchmarks.client import CompletionClient, ServerError, add_eval_client_arguments, base_url, gather_with_progress
from arfusion.benchmarks.gsm8k import scoring

RAW_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
CACHE_DIR = Path.home() / ".cache" / "arfusion" / "gsm8k"


@dataclass
class Gsm8kResult:
    """Metrics of one run (fractions in [0, 1]) and one record per question."""

    accuracy: float
    invalid: float
    latency_s: float
    output_throughput: Optional[float]
    num_questions: int
    num_shots: int
    records: list[dict[str, Any]] = field(repr=False)

    def metrics(self) -> dict[str, Any]:
        """The scalar metrics (everything but the records)."""
        return {k: v for k, v in asdict(self).items() if k != "records"}


def load_jsonl(path: Path) -> list[dict[str, str]]:
    """Rows of a JSON-lines file; each must have ``question`` and ``answer``."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{lineno}: a GSM8K row needs 'question' and 'answer'")
            rows.append(row)
    return rows


def download(split: str, cache_dir: Path = CACHE_DIR) -> Path:
    """The public ``split`` file (test or train), downloaded once into ``cache_dir``."""
    target = cache_dir / f"{split}.jsonl"
    if target.exists():
        return target
    url = RAW_URL.format(split=split)
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            data = resp.read()
    except (urllib.error.URLError, TimeoutError) as exc:
        raise SystemExit(
            f"could not download {url} ({exc}). Offline? Pass --data-path /path/to/test.jsonl "
            "(with train.jsonl next to it, or --train-path)."
        ) from None
    partial = target.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(target)
    return target


def resolve_paths(data_path: Optional[str], train_path: Optional[str]) -> tuple[Path, Path]:
    """(test file, train file): the given paths, train.jsonl next to the test file, or downloads."""
    test = Path(data_path) if data_path else download("test")
    if train_path:
        train = Path(train_path)
    elif data_path:
        train = test.parent / "train.jsonl"
    else:
        train = download("train")
    return test, train


async def evaluate(
    url: str, questions: Sequence[dict[str, str]], shots: Sequence[dict[str, str]], parallel: int,
    max_tokens: int, temperature: float, seed: Optional[int] = None, progress: bool = True,
) -> Gsm8kResult:
    """Ask every question with the same shots; extraction and scoring per `scoring`."""
    async with CompletionClient(url, max_concurrency=parallel) as client:
        start = time.perf_counter()
        completions = await gather_with_progress(
            (client.complete(scoring.build_prompt(shots, q["question"]), max_tokens=max_tokens,
                             temperature=temperature, stop=scoring.STOP, seed=seed) for q in questions),
            desc="gsm8k", disable=not progress,
        )
        latency = time.perf_counter() - start
    records = []
    for index, (q, c) in enumerate(zip(questions, completions)):
        label = scoring.parse_label(q["answer"])
        pred = scoring.extract_answer(c.text)
        records.append({
            "id": str(index), "generation": c.text, "prediction": None if pred is None else str(pred),
            "label": str(label), "correct": scoring.is_correct(pred, label), "completion_tokens": c.completion_tokens,
        })
    n = len(records)
    tokens = [r["completion_tokens"] for r in records]
    throughput = sum(tokens) / latency if tokens and None not in tokens and latency > 0 else None
    return Gsm8kResult(
        accuracy=sum(r["correct"] for r in records) / n,
        invalid=sum(r["prediction"] is None for r in records) / n,
        latency_s=latency, output_throughput=throughput, num_questions=n, num_shots=len(shots), records=records,
    )


def run(args: argparse.Namespace) -> Gsm8kResult:
    """Load the data named by ``args`` (from `build_parser`), evaluate, print, append the result."""
    test_path, train_path = resolve_paths(args.data_path, args.train_path)
    questions = load_jsonl(test_path)[: args.num_questions]
    shots: list[dict[str, str]] = []
    if args.num_shots > 0:
        if not train_path.exists():
            raise SystemExit(f"no train file for the shots at {train_path}: pass --train-path or --num-shots 0")
        shots = load_jsonl(train_path)[: args.num_shots]
        if len(shots) < args.num_shots:
            raise SystemExit(f"--num-shots {args.num_shots} but {train_path} has only {len(shots)} rows")
    if not questions:
        raise SystemExit(f"no questions in {test_path}")
    result = asyncio.run(evaluate(
        base_url(args.host, args.port), questions, shots, args.parallel, args.max_tokens,
        args.temperature, args.seed, progress=not args.no_progress,
    ))
    print_result(result)
    if args.result_file:
        line = {"task": "gsm8k", "data_path": str(test_path), **result.metrics()}
        with open(args.result_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    return result


def print_result(result: Gsm8kResult) -> None:
    throughput = "n/a (no usage)" if result.output_throughput is None else f"{result.output_throughput:.1f} token/s"
    print(f"Accuracy: {result.accuracy:.3f}")
    print(f"Invalid: {result.invalid:.3f}")
    print(f"Latency: {result.latency_s:.3f} s")
    print(f"Output throughput: {throughput}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arfusion.benchmarks.gsm8k", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", help="test JSON-lines file (default: download the public one)")
    p.add_argument("--train-path", help="train JSON-lines file for the shots (default: train.jsonl next to --data-path)")
    p.add_argument("--num-shots", type=int, default=8, help="few-shot examples from the train file")
    p.add_argument("--num-questions", type=int, default=None, help="first N test questions (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    add_eval_client_arguments(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_shots < 0 or (args.num_questions is not None and args.num_questions < 1) or args.parallel < 1:
        raise SystemExit("--num-shots must be >= 0, --num-questions and --parallel >= 1")
    try:
        run(args)
    except ServerError as exc:
        raise SystemExit(f"error: {exc}") from None
    return 0
