"""Decode-sized linear layers on one GPU: torch's F.linear (cuBLAS) against the Triton skinny
GEMM (`layers/triton_skinny_gemm.py`) with its default launch choice and with every setting of
a small grid, at the llama3-8b TP2 shapes (qkv [3072, 4096], o_proj [4096, 2048], gate_up
[14336, 4096], down_proj [4096, 7168]), bf16. µs per call (`time_linear`: a CUDA graph of 32
calls over weights larger than L2). Prints a table and writes every point as JSON.

    python -m benchmarks.kernels.sweep_skinny_gemm --m 1 8 32 64 --json-file out.json
"""
from __future__ import annotations

import argparse
import itertools
import json
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from layers.triton_skinny_gemm import SkinnyConfig, choose_config, skinny_linear, time_linear

SHAPES = {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (14336, 4096), "down_proj": (4096, 7168)}
GRID = [SkinnyConfig(bn, bk, w, s) for bn, bk, w, s in
        itertools.product((16, 32, 64), (128, 256), (4,), (3, 4, 6))]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--json-file")
    args = p.parse_args(argv)
    points = []
    print(f"{'layer':>9} {'M':>3} {'cuBLAS':>8} {'default':>8} {'best':>8}  best setting")
    for (name, (n, k)), m in itertools.product(SHAPES.items(), args.m):
        cublas = time_linear(m, n, k, F.linear)
        default = time_linear(m, n, k, skinny_linear)
        grid = {}
        for cfg in GRID:
            try:
                grid[cfg] = time_linear(m, n, k, lambda x, w, c=cfg: skinny_linear(x, w, config=c))
            except Exception as exc:  # a setting the compiler refuses (shared memory): skip it
                print(f"  skip {name} M={m} {cfg}: {type(exc).__name__}")
        best = min(grid, key=grid.get)
        print(f"{name:>9} {m:>3} {cublas:>8.2f} {default:>8.2f} {grid[best]:>8.2f}  {best} "
              f"(default {choose_config(m, n, k)})", flush=True)
        points.append({"layer": name, "m": m, "n": n, "k": k, "cublas_us": cublas, "default_us": default,
                       "grid": [{**vars(c), "us": us} for c, us in grid.items()]})
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(points, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
