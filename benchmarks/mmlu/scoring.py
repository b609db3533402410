r"""MMLU text handling: the Hendrycks CSV format, the few-shot prompt, the answer letter.

CSV: one question per row, no header, six fields ``question, A, B, C, D, answer`` with the
answer a letter A-D; fields may hold quoted commas and newlines, so rows are read with `csv`.

Prompt (Hendrycks et al.)::

    The following are multiple choice questions (with answers) about <subject>.\n\n
    <question>\nA. <a>\nB. <b>\nC. <c>\nD. <d>\nAnswer: <letter>\n\n     (k dev shots)
    <question>\nA. <a>\nB. <b>\nC. <c>\nD. <d>\nAnswer:

where <subject> is the file stem with underscores as spaces (``high_school_physics`` ->
``high school physics``).

Chat prompt (``--style simple-evals``: OpenAI's simple-evals, the form SGLang's all-reduce fusion
work reported MMLU in): zero-shot, one user message that asks for reasoning and a last line
``Answer: <letter>``::

    Answer the following multiple choice question. The last line of your response should be of
    the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think
    step by step before answering.\n\n<question>\n\nA) <a>\nB) <b>\nC) <c>\nD) <d>

and the letter is the one after the last ``Answer:`` of the reply (`parse_answer_line`; case and
spaces around the colon free, the letter may sit in ``$`` or ``**``); none means invalid.

Letter parsing: the first A-D that stands alone (not inside a word such as "Answer", not next
to an apostrophe as in "I'd"); upper case is preferred, lower case (" d.") is taken only when
no upper-case letter stands alone. No such letter means invalid.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

CHOICES = ("A", "B", "C", "D")
_ALONE = r"(?<![A-Za-z0-9_'’]){}(?![A-Za-z0-9_'’])"
_UPPER = re.compile(_ALONE.format("([A-D])"))
_LOWER = re.compile(_ALONE.format("([a-d])"))


@dataclass(frozen=True)
class McQuestion:
    """One multiple-choice row: the question, four options (A-D order) and the answer letter."""

    question: str
    options: tuple[str, str, str, str]
    answer: str


def read_csv(path: Path) -> list[McQuestion]:
    """All rows of a Hendrycks CSV file; raises ValueError naming the row when one is malformed."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for index, row in enumerate(csv.reader(f)):
            if len(row) != 6:
                raise ValueError(f"{path} row {index}: expected 6 fields, got {len(row)}")
            answer = row[5].strip()
            if answer not in CHOICES:
                raise ValueError(f"{path} row {index}: answer {row[5]!r} is not one of A-D")
            rows.append(McQuestion(row[0], (row[1], row[2], row[3], row[4]), answer))
    return rows


def subject_title(subject: str) -> str:
    """``high_school_physics`` -> ``high school physics``."""
    return subject.replace("_", " ")


def format_question(q: McQuestion, with_answer: bool) -> str:
    """The question and lettered options, ending ``Answer:`` (plus `` X\\n\\n`` for a shot)."""
    lines = [q.question] + [f"{letter}. {option}" for letter, option in zip(CHOICES, q.options)]
    text = "\n".join(lines) + "\nAnswer:"
    return text + f" {q.answer}\n\n" if with_answer else text


def build_prompt(subject: str, shots: Sequence[McQuestion], question: McQuestion) -> str:
    """Header, the solved shots, then the open question."""
    header = f"The following are multiple choice questions (with answers) about {subject_title(subject)}.\n\n"
    return header + "".join(format_question(s, True) for s in shots) + format_question(question, False)


CHAT_INSTRUCTION = ("Answer the following multiple choice question. The last line of your response should be of the "
                    "following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by "
                    "step before answering.")
_ANSWER_LINE = re.compile(r"answer[ \t]*:[ \t]*[$*(]*([A-D])\b", re.IGNORECASE)


def build_chat_prompt(question: McQuestion) -> str:
    """The simple-evals user message (module docstring)."""
    options = "\n".join(f"{letter}) {option}" for letter, option in zip(CHOICES, question.options))
    return f"{CHAT_INSTRUCTION}\n\n{question.question}\n\n{options}"


def parse_answer_line(reply: str) -> Optional[str]:
    """The letter after the last ``Answer:`` in ``reply`` (upper case), or None."""
    found = _ANSWER_LINE.findall(reply)
    return found[-1].upper() if found else None


def parse_letter(generation: str) -> Optional[str]:
    """The chosen letter (upper case) in ``generation``, or None (see the module docstring)."""
    match = _UPPER.search(generation) or _LOWER.search(generation)
    return match.group(1).upper() if match else None
