"""Two runs of the same questions, compared question by question: is one less accurate than the
other, or is the difference noise?

For questions answered by both runs (matched by id), ``b`` = #(A correct, B wrong) and
``c`` = #(A wrong, B correct), out of ``n``. The difference of accuracies, in points:

    diff = 100 * (c - b) / n

McNemar's exact test: under "A and B are equally accurate" each discordant question is B's win
with probability 1/2, so

    p = min(1, 2 * P(X <= min(b, c))),   X ~ Binomial(b + c, 1/2)     (p = 1 when b + c = 0)

The paired 95 % confidence interval of ``diff`` (Wald, on the per-question differences
d_i in {-1, 0, 1}, whose variance is ((b + c) / n - ((c - b) / n)^2) / n):

    diff +- 1.96 * 100 * sqrt((b + c) - (c - b)^2 / n) / n

`verdict` of B against A with ``tolerance`` points:
  "fail"         the drop is significant (diff < 0 and p < `ALPHA`), or the whole interval lies
                 below -tolerance;
  "inconclusive" otherwise, when the interval's half-width exceeds the tolerance (too few
                 questions to tell a drop of ``tolerance`` points from noise);
  "pass"         otherwise.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

ALPHA = 0.01  # a drop is significant below this p-value
Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


@dataclass(frozen=True)
class PairedComparison:
    """B against A on ``n`` shared questions (module docstring); points are percent."""

    n: int
    a_only: int  # b: A correct, B wrong
    b_only: int  # c: A wrong, B correct
    diff: float
    ci_low: float
    ci_high: float
    p_value: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` against ``c`` discordant pairs."""
    k, m = min(b, c), b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def paired(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> PairedComparison:
    """Compare the per-question records (``id``, ``correct``) of run B with run A's."""
    correct_b = {r["id"]: bool(r["correct"]) for r in b}
    pairs = [(bool(r["correct"]), correct_b[r["id"]]) for r in a if r["id"] in correct_b]
    n = len(pairs)
    if n == 0:
        raise ValueError("the two runs share no question id: nothing to compare")
    a_only = sum(x and not y for x, y in pairs)
    b_only = sum(y and not x for x, y in pairs)
    diff = 100.0 * (b_only - a_only) / n
    half = Z95 * 100.0 * math.sqrt(max(0.0, (a_only + b_only) - (b_only - a_only) ** 2 / n)) / n
    return PairedComparison(n, a_only, b_only, diff, diff - half, diff + half, mcnemar_exact_p(a_only, b_only))


def verdict(cmp: PairedComparison, tolerance: float) -> str:
    """"fail", "inconclusive" or "pass" (module docstring)."""
    if (cmp.diff < 0 and cmp.p_value < ALPHA) or cmp.ci_high < -tolerance:
        return "fail"
    if (cmp.ci_high - cmp.ci_low) / 2 > tolerance:
        return "inconclusive"
    return "pass"


def describe(name: str, cmp: PairedComparison, tolerance: float) -> str:
    """One line: the difference, its interval, the discordant counts, McNemar's p and the verdict."""
    return (f"{name}: {cmp.diff:+.2f} points, 95 % CI [{cmp.ci_low:+.2f}, {cmp.ci_high:+.2f}] over {cmp.n} questions; "
            f"discordant {cmp.a_only} vs {cmp.b_only}, McNemar exact p = {cmp.p_value:.3g} -> "
            f"{verdict(cmp, tolerance).upper()} (tolerance {tolerance:g} points)")
