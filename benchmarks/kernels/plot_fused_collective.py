"""Plot the JSON of benchmark_fused_collective: speedup over the faster standard path vs
tokens (log x), one line per (hidden size, path), one panel per (dtype, quant mode, residual).

    python benchmarks/kernels/plot_fused_collective.py results.json speedup.png
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

PanelKey = tuple[str, str, bool]  # (dtype, quant_mode, residual)
LineKey = tuple[int, str]  # (hidden_dim, path)
STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def speedup_series(doc: dict[str, Any]) -> dict[PanelKey, dict[LineKey, list[tuple[int, float]]]]:
    """``{panel: {(hidden, path): [(seq_len, speedup), ...] sorted by seq_len}}`` for every
    path with a speedup, except the baseline (always 1)."""
    panels: dict[PanelKey, dict[LineKey, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for cfg in doc["configs"]:
        panel = (cfg["dtype"], cfg["quant_mode"], cfg["residual"])
        for path in cfg["paths"]:
            if path.get("speedup") is not None and path["name"] != cfg["baseline"]:
                panels[panel][(cfg["hidden_dim"], path["name"])].append((cfg["seq_len"], path["speedup"]))
    return {p: {k: sorted(v) for k, v in sorted(lines.items())} for p, lines in sorted(panels.items())}


def plot(doc: dict[str, Any], out: Path) -> None:
    """Write the figure to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = speedup_series(doc)
    if not series:
        raise SystemExit("no speedups in the JSON: did every path fail?")
    names = sorted({name for lines in series.values() for _, name in lines})
    hiddens = sorted({hidden for lines in series.values() for hidden, _ in lines})
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}  # colour: path
    styles = {h: STYLES[i % len(STYLES)] for i, h in enumerate(hiddens)}  # line style + marker: hidden
    cols = min(2, len(series))
    rows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    for ax, ((dtype, quant, residual), lines) in zip(axes.flat, series.items()):
        for (hidden, name), points in lines.items():
            xs, ys = zip(*points)
            linestyle, marker = styles[hidden]
            ax.plot(xs, ys, color=colors[name], linestyle=linestyle, marker=marker, markersize=3,
                    label=f"{name} (h={hidden})")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("speedup vs faster standard path")
        ax.set_title(f"{dtype}, quant={quant}, residual={residual}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    meta = doc.get("meta", {})
    fig.suptitle(f"fused all-reduce + RMSNorm, TP{meta.get('world_size', '?')} on {meta.get('device', '?')}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_file", type=Path, help="--json-file output of benchmark_fused_collective.py")
    parser.add_argument("png_file", type=Path, help="where to write the figure")
    args = parser.parse_args()
    plot(json.loads(args.json_file.read_text()), args.png_file)


if __name__ == "__main__":
    main()
