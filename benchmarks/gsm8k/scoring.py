r"""GSM8K text handling: few-shot prompt format, answer extraction, label parsing.

Prompt (chain of thought, k shots from the train split)::

    Question: <shot question>\nAnswer: <shot reasoning>\nThe answer is <n>.\n\n   (k times)
    Question: <question>\nAnswer:

A shot's reasoning is the data set's answer with the calculator annotations ``<<48/2=24>>``
removed and its final line ``#### 72`` rewritten as ``The answer is 72.``, so that the model
is taught to end with the phrase `extract_answer` looks for first.

Extraction: the number right after the first "The answer is" (or "####") that is followed by
one (spaces, ``:``, ``**`` and ``\boxed{`` may come between); when there is none, the last
number anywhere in the generation; no number at all means invalid.
Numbers may carry a sign (``-`` or ``−``), a ``$``, thousands commas (``1,234``) and decimals
(``0.5``, ``.5``); a trailing sentence period is not a decimal point. Values compare as
`decimal.Decimal`, so ``18``, ``18.0`` and ``$18.00`` are equal.
"""
from __future__ import annotations

import re
from decimal import Decimal
from typing import Optional, Sequence

STOP = ["Question", "</s>", "<|im_end|>", "\n\n\n"]

_CALCULATOR = re.compile(r"<<[^<>]*>>")
_MARKER = re.compile(r"(?:the answer is|####)[\s:*]*(?:\\boxed\{)?", re.IGNORECASE)
_NUMBER = re.compile(
    r"(?<![\w.])(?P<neg>[-−])?\$?(?P<neg2>-)?"
    r"(?P<body>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
)


def _to_decimal(match: re.Match[str]) -> Decimal:
    value = Decimal(match.group("body").replace(",", ""))
    return -value if (match.group("neg") or match.group("neg2")) else value


def find_numbers(text: str) -> list[Decimal]:
    """Every number in ``text``, in order (see the module docstring for the accepted forms)."""
    return [_to_decimal(m) for m in _NUMBER.finditer(text)]


def extract_answer(generation: str) -> Optional[Decimal]:
    """The model's final answer in ``generation``, or None when it contains no number."""
    for marker in _MARKER.finditer(generation):
        number = _NUMBER.match(generation, marker.end())
        if number:
            return _to_decimal(number)
    numbers = find_numbers(generation)
    return numbers[-1] if numbers else None


def parse_label(answer: str) -> Decimal:
    """The reference answer: the number after the last ``####`` of a GSM8K answer field."""
    head, sep, tail = answer.rpartition("####")
    numbers = find_numbers(tail) if sep else []
    if not numbers:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return numbers[0]


def format_shot(question: str, answer: str) -> str:
    """One solved example: ``Question: q\\nAnswer: reasoning\\nThe answer is n.\\n\\n``."""
    reasoning = _CALCULATOR.sub("", answer.rpartition("####")[0]).strip()
    label = parse_label(answer)
    return f"Question: {question.strip()}\nAnswer: {reasoning}\nThe answer is {label}.\n\n"


def format_question(question: str) -> str:
    """The open question that ends a prompt: ``Question: q\\nAnswer:``."""
    return f"Question: {question.strip()}\nAnswer:"


def build_prompt(shots: Sequence[dict[str, str]], question: str) -> str:
    """The few-shot prompt: every shot (rows with ``question`` and ``answer``) then the question."""
    return "".join(format_shot(s["question"], s["answer"]) for s in shots) + format_question(question)


def is_correct(prediction: Optional[Decimal], label: Decimal) -> bool:
    """True when the extracted answer equals the label numerically (None is never correct)."""
    return prediction is not None and prediction == label
