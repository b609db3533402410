"""Fit the built-in rule's cost model (`fusion.dispatch.cost_model`) to measured strategy tables.

    python -m arfusion.benchmarks.fit_cost_model fusion/dispatch/tables/strategy_table.json [more tables] \\
        [--gpu "NVIDIA H200"] [--world-size 2] [--dtype bfloat16] [--json-file fit.json]

Per strategy, relative least squares of ``t = a + b * MiB + c * rows`` over every (hidden,
tokens) the tables hold (MiB: the message per rank, rows: tokens / world). Prints the
coefficients as each strategy's declaration writes them (``cost=`` in `fusion.strategies`), and, per (hidden, tokens), the
strategy the model picks against the measured fastest: the ratio best / picked (1.0 = the
model picks the fastest; the rule's target is >= 0.95 everywhere).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from arfusion.fusion.strategy import Strategy
from arfusion.fusion.dispatch.table import parse_table


def samples(paths: Sequence[str], gpu: str, world: int, dtype: str) -> list[tuple[int, int, dict[str, float]]]:
    """(hidden, tokens, {strategy: µs}) of the matching entries of every table."""
    out = []
    for path in paths:
        for e in parse_table(json.loads(Path(path).read_text())):
            if (e["gpu"], e["world_size"], e["dtype"]) == (gpu, world, dtype):
                out += [(e["hidden"], int(t), row) for t, row in e["timings_us"].items()]
    return out


def features(hidden: int, tokens: int, world: int, itemsize: int) -> list[float]:
    return [1.0, tokens * hidden * itemsize / 2**20, tokens / world]


def fit(data: list[tuple[int, int, dict[str, float]]], world: int, itemsize: int) -> dict[str, list[float]]:
    """Per strategy, ``[a, b, c]`` minimising the relative squared error."""
    coefficients = {}
    for strategy in sorted({s for _, _, row in data for s in row}):
        points = [(features(h, t, world, itemsize), row[strategy]) for h, t, row in data if strategy in row]
        x = np.array([f for f, _ in points])
        y = np.array([us for _, us in points])
        weights = 1.0 / y
        coefficients[strategy] = np.linalg.lstsq(x * weights[:, None], y * weights, rcond=None)[0].tolist()
    return coefficients


def choices(data: list[tuple[int, int, dict[str, float]]], coefficients: dict[str, list[float]], world: int,
            itemsize: int) -> list[dict[str, Any]]:
    """Per (hidden, tokens): the model's pick among the measured strategies, and best / picked."""
    rows = []
    for h, t, row in sorted(data, key=lambda r: (r[0], r[1])):
        f = features(h, t, world, itemsize)
        picked = min(row, key=lambda s: float(np.dot(coefficients[s], f)))
        best = min(row, key=row.__getitem__)
        rows.append({"hidden": h, "tokens": t, "picked": picked, "best": best, "ratio": row[best] / row[picked]})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tables", nargs="+", help="strategy tables (engine.tune_fusion output)")
    p.add_argument("--gpu", default="NVIDIA H200", help="GPU name of the entries to fit (default: NVIDIA H200)")
    p.add_argument("--world-size", type=int, default=2, help="world size of the entries to fit (default: 2)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the entries to fit (default: bfloat16)")
    p.add_argument("--json-file", help="write the coefficients and the per-size choices here (default: none)")
    args = p.parse_args(argv)
    itemsize = 4 if args.dtype == "float32" else 2
    data = samples(args.tables, args.gpu, args.world_size, args.dtype)
    if not data:
        print(f"error: no entry for {args.gpu}, TP{args.world_size}, {args.dtype} in {args.tables}", file=sys.stderr)
        return 2
    coefficients = fit(data, args.world_size, itemsize)
    rows = choices(data, coefficients, args.world_size, itemsize)
    for strategy, (a, b, c) in coefficients.items():
        print(f"{Strategy(strategy).name}: cost={{{args.world_size}: ({a:.4g}, {b:.4g}, {c:.4g})}}")
    for r in rows:
        flag = "" if r["ratio"] >= 0.95 else "   < 0.95"
        print(f"hidden {r['hidden']:5d} tokens {r['tokens']:5d}: picks {r['picked']:<20} best {r['best']:<20} "
              f"{r['ratio']:.3f}{flag}")
    print(f"worst best/picked: {min(r['ratio'] for r in rows):.3f} over {len(rows)} sizes")
    if args.json_file:
        Path(args.json_file).write_text(json.dumps({"coefficients": coefficients, "choices": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
