"""The batch-invariant Triton matmul (layers/kernels/triton_bi_matmul.py) against cuBLAS
(``F.linear``) on one GPU, at llama3-8b TP1 GEMM shapes (bf16) and decode/prefill row counts.
Each time is the median of CUDA-graph replays of up to 20 calls on distinct weights, at most
200 MiB of them (µs per call): more than L2 holds, as in a forward. Also checks, per shape, that row 0's bits are the same at
every M (a failed check is printed, not hidden).

    python -m arfusion.benchmarks.kernels.bench_bi_matmul --rows 1 32 128 2048 --json-file out.json
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

import torch
import torch.nn.functional as F

from arfusion.benchmarks.kernels.graph_timing import median_replay_us
from arfusion.layers.kernels.triton_bi_matmul import choose_config, matmul

# (name, N, K) of llama3-8b at TP1
SHAPES = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336), ("lm_head", 128256, 4096))
CALLS = 20


def time_us(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: list, ws: list) -> float:
    """Median µs per call over CUDA-graph replays of one call per weight in ``ws``."""
    for x, w in zip(xs, ws):
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws):
            fn(x, w)
    return median_replay_us(graph, len(ws))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 2048])
    parser.add_argument("--json-file", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    print(f"{'shape':>14} {'M':>6} {'cublas us':>10} {'bi us':>8} {'ratio':>6}  config")
    for name, n, k in SHAPES:
        calls = max(1, min(CALLS, (200 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(calls)]
        x_all = torch.randn(max(args.rows), k, dtype=torch.bfloat16, device="cuda")
        row0 = matmul(x_all[:1], ws[0])
        invariant = all(torch.equal(matmul(x_all[:m], ws[0])[:1], row0) for m in args.rows)
        close = torch.allclose(matmul(x_all[:64], ws[0]).float(), F.linear(x_all[:64], ws[0]).float(),
                               atol=2e-2, rtol=2e-2)
        for m in args.rows:
            xs = [x_all[:m]] * calls
            t_ref = time_us(lambda x, w: F.linear(x, w), xs, ws[:calls])
            t_bi = time_us(matmul, xs, ws[:calls])
            cfg = choose_config(n, k, m)
            results.append({"shape": name, "n": n, "k": k, "m": m, "cublas_us": t_ref, "bi_us": t_bi,
                            "config": cfg._asdict(), "row_invariant": invariant, "close_to_cublas": close})
            print(f"{name:>14} {m:>6} {t_ref:>10.1f} {t_bi:>8.1f} {t_bi / t_ref:>6.2f}  {tuple(cfg)}"
                  + ("" if invariant and close else f"  INVARIANT={invariant} CLOSE={close}"))
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
