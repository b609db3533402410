"""Plots of the engine benchmarks: decode TPOT per batch size (bench_one_batch JSONL) and
serving TPOT / throughput per concurrency (bench_serving JSONL, fusion off and on).

    python -m arfusion.benchmarks.plot_engine_results --one-batch B.jsonl --serving-off OFF.jsonl \\
        --serving-on ON.jsonl --output docs/results/engine.png
"""
from __future__ import annotations

import argparse
import json


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one-batch", required=True)
    p.add_argument("--serving-off", required=True)
    p.add_argument("--serving-on", required=True)
    p.add_argument("--output", required=True)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = _lines(args.one_batch)[-1]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for setting, style in (("off", "o-"), ("on", "s-"), ("builtin", "^--")):
        rows = [r for r in run["results"] if r["fusion"] == setting]
        if not rows:
            continue
        axes[0].plot([r["batch_size"] for r in rows], [r["tpot_ms"] for r in rows], style, label=f"fusion {setting}")
    axes[0].set(xscale="log", xlabel="batch size", ylabel="decode TPOT (ms)",
                title=f"bench_one_batch {run['args']['model_path']} TP{run['args']['tp_size']}")
    serving = {"off": _lines(args.serving_off), "on": _lines(args.serving_on)}
    for setting, style in (("off", "o-"), ("on", "s-")):
        rows = serving[setting]
        conc = [r["max_concurrency"] for r in rows]
        axes[1].plot(conc, [r["median_tpot_ms"] for r in rows], style, label=f"fusion {setting}")
        axes[2].plot(conc, [r["output_throughput"] for r in rows], style, label=f"fusion {setting}")
    axes[1].set(xscale="log", xlabel="max concurrency", ylabel="median TPOT (ms)", title="serving: TPOT")
    axes[2].set(xscale="log", xlabel="max concurrency", ylabel="output tokens/s", title="serving: throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
