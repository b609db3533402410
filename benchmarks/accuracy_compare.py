"""The comparison of the accuracy runs: metric rows of off vs on (and off vs a baseline), the
generation agreement of two runs, the printed table and the exit status of the checks."""
from __future__ import annotations

from typing import Any, Optional, Sequence

ACCURACY_METRICS = ("accuracy",)
REPORTED_METRICS = ("accuracy", "invalid", "latency_s", "output_throughput")


def generation_agreement(off: Sequence[dict[str, Any]], on: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Compare the generations of the same questions (matched by ``id``) in two runs.

    agreement = sum over questions of #{i : off_tokens[i] == on_tokens[i]} divided by the sum of
    max(len(off_tokens), len(on_tokens)), tokens being whitespace-separated words (1.0 when all
    are empty); identical = fraction of questions with exactly equal text.
    """
    on_by_id = {r["id"]: r["generation"] for r in on}
    common = [(r["generation"], on_by_id[r["id"]]) for r in off if r["id"] in on_by_id]
    matched = total = identical = 0
    for a, b in common:
        ta, tb = a.split(), b.split()
        matched += sum(x == y for x, y in zip(ta, tb))
        total += max(len(ta), len(tb))
        identical += a == b
    return {"questions": len(common), "agreement": matched / total if total else 1.0,
            "identical": identical / len(common) if common else 1.0}


def compare(off: dict[str, dict[str, Any]], on: dict[str, dict[str, Any]], tolerance_points: float,
            baseline: Optional[dict[str, dict[str, Any]]] = None, baseline_tolerance_points: float = 1.0,
            ) -> list[dict[str, Any]]:
    """Rows ``{metric, baseline, off, on, diff, baseline_diff, checked, exceeds, baseline_exceeds}``
    for every eval's reported metrics (``baseline*`` None / False without a baseline).

    Fractions (accuracy, invalid) are turned into points (percent); ``diff = on - off``,
    ``baseline_diff = off - baseline``. Accuracy rows are checked: ``exceeds`` when
    ``|diff| > tolerance_points``, ``baseline_exceeds`` when ``|baseline_diff| > baseline_tolerance_points``.
    """
    def value(metrics: Optional[dict[str, dict[str, Any]]], eval_name: str, metric: str, scale: float) -> Optional[float]:
        v = None if metrics is None else metrics.get(eval_name, {}).get(metric)
        return None if v is None else v * scale

    def delta(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or b is None else a - b

    rows = []
    for eval_name in off:
        for metric in (m for m in REPORTED_METRICS if m in off[eval_name]):
            scale = 100.0 if metric in ("accuracy", "invalid") else 1.0
            a, b, c = (value(m, eval_name, metric, scale) for m in (off, on, baseline))
            diff, baseline_diff = delta(b, a), delta(a, c)
            checked = metric in ACCURACY_METRICS
            rows.append({
                "metric": f"{eval_name} {metric}" + (" (%)" if scale == 100.0 else ""), "baseline": c, "off": a, "on": b,
                "diff": diff, "baseline_diff": baseline_diff, "checked": checked,
                "exceeds": checked and (diff is None or abs(diff) > tolerance_points),
                "baseline_exceeds": checked and baseline is not None and (
                    baseline_diff is None or abs(baseline_diff) > baseline_tolerance_points),
            })
    return rows


def format_table(rows: Sequence[dict[str, Any]], agreement: dict[str, dict[str, Any]],
                 baseline_agreement: Optional[dict[str, dict[str, Any]]] = None,
                 titles: Optional[dict[str, str]] = None) -> str:
    """The side-by-side table (a baseline column and an ``off - baseline`` column when the rows
    have a baseline), then the agreement lines per eval: on with off, then off with the baseline.
    ``titles``: column titles by label ("baseline", "off", "on")."""
    def cell(v: Optional[float]) -> str:
        return "n/a" if v is None else f"{v:.3f}"
    titles = {"baseline": "baseline", "off": "off", "on": "on"} | (titles or {})
    with_baseline = any(r["baseline"] is not None for r in rows)
    columns = (["baseline"] if with_baseline else []) + ["off", "on", "diff"] + (["baseline_diff"] if with_baseline else [])
    heads = titles | {"diff": "on - off" if with_baseline else "diff", "baseline_diff": "off - baseline"}
    width = max([len("metric")] + [len(r["metric"]) for r in rows])
    cw = max([10] + [len(heads[c]) for c in columns])
    lines = [f"{'metric':<{width}}" + "".join(f"  {heads[c]:>{cw}}" for c in columns)]
    for r in rows:
        flags = ("  EXCEEDS TOLERANCE" if r["exceeds"] else "") + ("  EXCEEDS BASELINE TOLERANCE" if r["baseline_exceeds"] else "")
        lines.append(f"{r['metric']:<{width}}" + "".join(f"  {cell(r[c]):>{cw}}" for c in columns) + flags)
    for label, agreements in (("", agreement), (" of off with the baseline", baseline_agreement or {})):
        for name, a in agreements.items():
            lines.append(f"{name} generation agreement{label}: {a['agreement']:.4f} of tokens, "
                         f"{a['identical']:.4f} of {a['questions']} generations identical")
    return "\n".join(lines)


def exit_code(rows: Sequence[dict[str, Any]]) -> int:
    """1 when a checked row exceeds a tolerance, else 0."""
    return 1 if any(r["exceeds"] or r["baseline_exceeds"] for r in rows) else 0
