"""MMLU multiple-choice accuracy against an OpenAI-compatible server, in one of two styles.

    python -m arfusion.benchmarks.mmlu --data-dir data --port 30000                                   # hendrycks
    python -m arfusion.benchmarks.mmlu --data-dir data --port 30000 --style simple-evals --examples 1000

``--style simple-evals`` (OpenAI's simple-evals, the form SGLang's all-reduce fusion work measured
MMLU in): zero-shot chat completions (``/v1/chat/completions``) that reason step by step and end
with ``Answer: <letter>`` (`scoring.build_chat_prompt`, `scoring.parse_answer_line`),
``--max-tokens`` 1024 by default, and ``--examples N`` draws N questions from all the chosen
subjects together (a sample seeded with 0, so every run asks the same ones). The default style,
``hendrycks``, is described next.

``--data-dir`` holds ``test/<subject>_test.csv`` and ``dev/<subject>_dev.csv`` (the Hendrycks
release: ``tar xf data.tar`` of people.eecs.berkeley.edu/~hendrycks/data.tar gives ``data/``).
The shots are the first ``--num-shots`` dev rows of the same subject (5, or 0 for zero-shot);
``--examples`` caps the test rows per subject; ``--subjects`` keeps only the named subjects.
Greedy decoding of ``--max-tokens`` tokens (2 by default); the letter is parsed by `scoring.parse_letter`.
Prints a per-subject table, the overall accuracy (all questions pooled) and the mean of the
per-subject accuracies; ``--result-file`` appends one JSON line per run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from arfusion.benchmarks.client import CompletionClient, ServerError, add_eval_client_arguments, base_url, gather_with_progress
from arfusion.benchmarks.mmlu import scoring


@dataclass
class SubjectData:
    """One subject's shots and test questions."""

    name: str
    shots: list[scoring.McQuestion]
    questions: list[scoring.McQuestion]


@dataclass
class MmluResult:
    """Pooled metrics (fractions), per-subject accuracy, and one record per question."""

    accuracy: float
    invalid: float
    macro_accuracy: float
    latency_s: float
    num_questions: int
    num_shots: int
    subjects: dict[str, dict[str, float]]
    records: list[dict[str, Any]] = field(repr=False)

    def metrics(self) -> dict[str, Any]:
        """Everything but the records."""
        return {k: v for k, v in asdict(self).items() if k != "records"}


def list_subjects(data_dir: Path) -> list[str]:
    """Subjects with a ``test/<subject>_test.csv`` file, sorted."""
    test_dir = data_dir / "test"
    if not test_dir.is_dir():
        raise SystemExit(f"{data_dir} has no test/ directory (expected test/<subject>_test.csv and dev/<subject>_dev.csv)")
    return sorted(p.name[: -len("_test.csv")] for p in test_dir.glob("*_test.csv"))


def load_subjects(data_dir: Path, subjects: Optional[Sequence[str]], num_shots: int, examples: Optional[int]) -> list[SubjectData]:
    """Read the chosen subjects; unknown subjects and too few dev rows are errors."""
    available = list_subjects(data_dir)
    chosen = list(subjects) if subjects else available
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise SystemExit(f"unknown subjects {unknown}; {data_dir / 'test'} has {len(available)} subjects")
    if not chosen:
        raise SystemExit(f"no *_test.csv files in {data_dir / 'test'}")
    loaded = []
    for name in chosen:
        questions = scoring.read_csv(data_dir / "test" / f"{name}_test.csv")[:examples]
        shots: list[scoring.McQuestion] = []
        if num_shots > 0:
            dev_path = data_dir / "dev" / f"{name}_dev.csv"
            if not dev_path.exists():
                raise SystemExit(f"--num-shots {num_shots} needs {dev_path}")
            shots = scoring.read_csv(dev_path)[:num_shots]
            if len(shots) < num_shots:
                raise SystemExit(f"--num-shots {num_shots} but {dev_path} has only {len(shots)} rows")
        loaded.append(SubjectData(name, shots, questions))
    return loaded


STYLES = ("hendrycks", "simple-evals")
SAMPLE_SEED = 0  # simple-evals' --examples sample
DEFAULT_MAX_TOKENS = {"hendrycks": 2, "simple-evals": 1024}


def select(subjects: Sequence[SubjectData], examples: Optional[int] = None) -> list[tuple[SubjectData, int, scoring.McQuestion]]:
    """(subject, index in its test file, question) of every question, or of ``examples`` of them
    drawn together from all subjects with `SAMPLE_SEED` (simple-evals' sample)."""
    items = [(s, i, q) for s in subjects for i, q in enumerate(s.questions)]
    if examples is None or examples >= len(items):
        return items
    return random.Random(SAMPLE_SEED).sample(items, examples)


async def evaluate(
    url: str, subjects: Sequence[SubjectData], parallel: int, max_tokens: int, temperature: float,
    seed: Optional[int] = None, progress: bool = True, style: str = "hendrycks", examples: Optional[int] = None,
) -> MmluResult:
    """Ask the questions (`select`; every one in the hendrycks style, where ``examples`` was
    applied per subject when loading); a question is correct when the parsed letter matches."""
    items = select(subjects, examples if style == "simple-evals" else None)
    if not items:
        raise SystemExit("no MMLU questions selected")
    async with CompletionClient(url, max_concurrency=parallel) as client:
        start = time.perf_counter()
        if style == "simple-evals":
            requests = (client.chat(scoring.build_chat_prompt(q), max_tokens=max_tokens, temperature=temperature,
                                    seed=seed) for _, _, q in items)
        else:
            requests = (client.complete(scoring.build_prompt(s.name, s.shots, q), max_tokens=max_tokens,
                                        temperature=temperature, seed=seed) for s, _, q in items)
        completions = await gather_with_progress(requests, desc="mmlu", disable=not progress)
        latency = time.perf_counter() - start
    parse = scoring.parse_answer_line if style == "simple-evals" else scoring.parse_letter
    records = []
    for (s, i, q), c in zip(items, completions):
        letter = parse(c.text)
        records.append({"id": f"{s.name}/{i}", "subject": s.name, "generation": c.text,
                        "prediction": letter, "label": q.answer, "correct": letter == q.answer})
    per_subject: dict[str, dict[str, float]] = {}
    for s in subjects:
        mine = [r for r in records if r["subject"] == s.name]
        if mine:  # a subject the sample missed has no row
            per_subject[s.name] = {
                "questions": len(mine),
                "accuracy": sum(r["correct"] for r in mine) / len(mine),
                "invalid": sum(r["prediction"] is None for r in mine) / len(mine),
            }
    n = len(records)
    return MmluResult(
        accuracy=sum(r["correct"] for r in records) / n,
        invalid=sum(r["prediction"] is None for r in records) / n,
        macro_accuracy=sum(v["accuracy"] for v in per_subject.values()) / len(per_subject),
        latency_s=latency, num_questions=n, num_shots=max(len(s.shots) for s in subjects),
        subjects=per_subject, records=records,
    )


def format_table(result: MmluResult) -> str:
    """Per-subject rows, then the pooled and the mean-of-subjects accuracy."""
    width = max([len("overall (pooled)")] + [len(s) for s in result.subjects])
    lines = [f"{'subject':<{width}}  {'questions':>9}  {'accuracy':>8}  {'invalid':>7}"]
    for name, row in result.subjects.items():
        lines.append(f"{name:<{width}}  {row['questions']:>9}  {row['accuracy']:>8.3f}  {row['invalid']:>7.3f}")
    lines.append("-" * len(lines[0]))
    lines.append(f"{'overall (pooled)':<{width}}  {result.num_questions:>9}  {result.accuracy:>8.3f}  {result.invalid:>7.3f}")
    lines.append(f"{'mean of subjects':<{width}}  {len(result.subjects):>9}  {result.macro_accuracy:>8.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> MmluResult:
    """Load the data named by ``args`` (from `build_parser`), evaluate, print, append the result."""
    subjects = args.subjects.replace(",", " ").split() if args.subjects else None
    simple = args.style == "simple-evals"
    num_shots = resolve_num_shots(args.style, args.num_shots)
    data = load_subjects(Path(args.data_dir), subjects, num_shots, None if simple else args.examples)
    max_tokens = args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS[args.style]
    result = asyncio.run(evaluate(base_url(args.host, args.port), data, args.parallel, max_tokens, args.temperature,
                                  args.seed, progress=not args.no_progress, style=args.style, examples=args.examples))
    print(format_table(result))
    print(f"Accuracy: {result.accuracy:.3f}")
    print(f"Invalid: {result.invalid:.3f}")
    print(f"Latency: {result.latency_s:.3f} s")
    if args.result_file:
        with open(args.result_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({"task": "mmlu", "data_dir": str(args.data_dir), **result.metrics()}) + "\n")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arfusion.benchmarks.mmlu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="directory with test/ and dev/ subdirectories of <subject>_{test,dev}.csv")
    p.add_argument("--style", choices=STYLES, default="hendrycks",
                   help="hendrycks: few-shot completions, the next letter; simple-evals: zero-shot chat, 'Answer: X' "
                        "after reasoning (default: %(default)s)")
    p.add_argument("--num-shots", type=int, default=None, help="dev examples per prompt (0-5; default 5, 0 for simple-evals)")
    p.add_argument("--examples", type=int, default=None,
                   help="hendrycks: at most N test questions per subject; simple-evals: N questions sampled from all "
                        "subjects (default: all)")
    p.add_argument("--subjects", default=None, help="comma- or space-separated subjects (default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 2 (hendrycks), 1024 (simple-evals)")
    add_eval_client_arguments(p)
    return p


def resolve_num_shots(style: str, num_shots: Optional[int]) -> int:
    """The shots: 5 unless given; simple-evals is zero-shot (other counts are refused)."""
    if style == "simple-evals":
        if num_shots not in (None, 0):
            raise SystemExit(f"--style simple-evals is zero-shot; --num-shots {num_shots} does not apply")
        return 0
    return 5 if num_shots is None else num_shots


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if resolve_num_shots(args.style, args.num_shots) < 0 or args.parallel < 1 or (args.examples is not None and args.examples < 1):
        raise SystemExit("--num-shots must be >= 0, --parallel and --examples >= 1")
    try:
        run(args)
    except ServerError as exc:
        raise SystemExit(f"error: {exc}") from None
    return 0
