"""Decode-sized matmuls: `layers.kernels.triton_skinny_matmul.skinny_linear` against ``F.linear``
(cuBLAS) at the projection shapes of llama3-8b, qwen3-30b-a3b and gpt-oss (TP1), bf16.

For each shape, token count and configuration: µs per matmul (median of 10 replays of a CUDA
graph that cycles through distinct weight copies of at least 256 MB in all, so no weight is
served from L2), the share of 4.8 TB/s of the weight bytes, and the relative error against an
fp32 matmul of the same bf16 inputs. ``--configs`` adds tiles (``block_n,block_k,warps,stages``).

    python -m arfusion.benchmarks.kernels.bench_skinny_matmul --tokens 1 8 32 --out out/skinny.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import median_us_per_call

HBM_BYTES_PER_US = 4.8e6
WEIGHT_BYTES_CYCLED = 256 << 20
# (model, projection, N, K) at TP1
SHAPES = [("llama3-8b", "qkv", 6144, 4096), ("llama3-8b", "o", 4096, 4096), ("llama3-8b", "gate_up", 28672, 4096),
          ("llama3-8b", "down", 4096, 14336), ("qwen3-30b-a3b", "qkv", 5120, 2048), ("qwen3-30b-a3b", "o", 2048, 4096),
          ("gpt-oss", "qkv", 5120, 2880), ("gpt-oss", "o", 2880, 4096)]
CANDIDATES = ["16,256,4,4", "32,256,4,4", "32,128,4,6", "64,128,4,4", "32,512,4,3", "16,512,4,4", "64,256,4,3"]


def cycled_weights(n: int, k: int) -> list[torch.Tensor]:
    """Distinct bf16 ``[n, k]`` weights N(0, 0.02) on the GPU, at least 4 and at least
    `WEIGHT_BYTES_CYCLED` bytes in all: a graph cycling through them finds none in L2."""
    copies = max(4, -(-WEIGHT_BYTES_CYCLED // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def time_in_graph(fn, weights: list[torch.Tensor]) -> float:
    """µs per call of ``fn(weight)`` over ``weights`` in one captured graph (`median_us_per_call`)."""
    return median_us_per_call(lambda: [fn(w) for w in weights], len(weights))


def main() -> None:
    from arfusion.layers.kernels.triton_skinny_matmul import SkinnyConfig, default_config, skinny_linear

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--configs", nargs="*", default=CANDIDATES)
    parser.add_argument("--out")
    args = parser.parse_args()
    extra = [SkinnyConfig(*map(int, c.split(","))) for c in args.configs]
    rows = []
    print(f"{'model':>14} {'proj':>7} {'N':>6} {'K':>6} {'M':>3} {'cuBLAS us':>9} {'%BW':>5}  best skinny (n,k,w,s)"
          f"{'us':>9} {'%BW':>5} {'x cuBLAS':>8} {'rel err':>8}  default us")
    for model, proj, n, k in SHAPES:
        nbytes = n * k * 2
        weights = cycled_weights(n, k)
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = time_in_graph(lambda w: F.linear(x, w), weights)
            ref = (x.float() @ weights[0].float().T)
            results = []
            for cfg in [default_config(n)] + extra:
                try:
                    err = ((skinny_linear(x, weights[0], None, cfg).float() - ref).norm() / ref.norm()).item()
                    results.append((time_in_graph(lambda w: skinny_linear(x, w, None, cfg), weights), cfg, err))
                except Exception as exc:  # a tile that does not compile (shared memory): reported, skipped
                    print(f"    {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
            best_us, best, err = min(results, key=lambda r: r[0])
            default_us = results[0][0]
            tiles = f"{best.block_n},{best.block_k},{best.num_warps},{best.num_stages}"
            print(f"{model:>14} {proj:>7} {n:>6} {k:>6} {m:>3} {cublas:>9.2f} {100 * nbytes / cublas / HBM_BYTES_PER_US:>4.0f}%"
                  f"  {tiles:>21}{best_us:>9.2f} {100 * nbytes / best_us / HBM_BYTES_PER_US:>4.0f}%"
                  f" {cublas / best_us:>8.2f} {err:>8.1e}  {default_us:.2f}")
            rows.append(dict(model=model, proj=proj, n=n, k=k, tokens=m, cublas_us=cublas, default_us=default_us,
                             skinny=[dict(config=r[1].__dict__, us=r[0], rel_err=r[2]) for r in results]))
        del weights
        torch.cuda.empty_cache()
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
