"""The batch-invariant Triton matmul (layers/kernels/triton_bi_matmul.py) against cuBLAS
(``F.linear``) on one GPU, at llama3-8b TP1 GEMM shapes (bf16) and decode/prefill row counts.
Each time is the median of CUDA-graph replays of up to 20 calls on distinct weights, at most
200 MiB of them (µs per call): more than L2 holds, as in a forward. Also checks, per shape, that row 0's bits are the same at
every M (a failed check is printed, not hidden).

    python -m arfusion.benchmarks.kernels.bench_bi_matmul --rows 1 32 128 2048 --json-file out.json

``--host``: the host time of one call instead (µs, median of `HOST_REPEATS` runs of `HOST_CALLS`
calls, no synchronization inside a run) at one row and tiny weights whose GPU time is below the
host's, so the wall time is Python and launch overhead: ``F.linear``, and the matmul through its
launch cache and through Triton's normal launch, with one K split and with several.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import median_us_per_call
from arfusion.layers.kernels import triton_bi_matmul
from arfusion.layers.kernels.triton_bi_matmul import choose_config, matmul

# (name, N, K) of llama3-8b at TP1
SHAPES = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336), ("lm_head", 128256, 4096))
CALLS = 20
HOST_SHAPES = ((256, 512), (64, 4096))  # (N, K): default configs of 1 and 8 K splits
HOST_CALLS, HOST_REPEATS = 200, 25


def host_us(fn: Callable[[], torch.Tensor]) -> float:
    """Median µs per call of ``fn`` over `HOST_REPEATS` runs of `HOST_CALLS` calls, each run
    timed from a synchronized GPU to the last call's return (its kernels may still run)."""
    for _ in range(HOST_CALLS):
        fn()
    runs = []
    for _ in range(HOST_REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        runs.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
    return statistics.median(runs)


def host_overhead() -> list[dict]:
    """`host_us` of ``F.linear`` and of the matmul with and without its launch cache, per
    `HOST_SHAPES` entry at one row; printed and returned."""
    launcher = triton_bi_matmul.MATMUL_LAUNCHER
    results = []
    print(f"{'N':>6} {'K':>6} {'splits':>6} {'F.linear us':>11} {'cached us':>9} {'uncached us':>11}")
    for n, k in HOST_SHAPES:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        row = {"n": n, "k": k, "m": 1, "splits": choose_config(n, k, 1).splits,
               "linear_us": host_us(lambda: F.linear(x, w)), "cached_us": host_us(lambda: matmul(x, w))}
        launcher.enabled = False
        row["uncached_us"] = host_us(lambda: matmul(x, w))
        launcher.enabled = True
        results.append(row)
        print(f"{n:>6} {k:>6} {row['splits']:>6} {row['linear_us']:>11.1f} {row['cached_us']:>9.1f} "
              f"{row['uncached_us']:>11.1f}")
    return results


def time_us(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: list, ws: list) -> float:
    """Median µs per call over CUDA-graph replays of one call per weight in ``ws``."""
    return median_us_per_call(lambda: [fn(x, w) for x, w in zip(xs, ws)], len(ws))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 2048])
    parser.add_argument("--json-file", default=None)
    parser.add_argument("--host", action="store_true", help="host µs per call instead (module docstring)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.host:
        results = host_overhead()
        write_rows(args.json_file, results)
        return
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
    write_rows(args.json_file, results)


if __name__ == "__main__":
    main()
