"""Micro-benchmark: the cost of one cached fusion decision in eager Python (CPU).

    python -m benchmarks.bench_dispatch_overhead [--calls 1000000] [--batch-sizes 64]

Times `FusionDispatcher.should_fuse_allreduce_residual_rmsnorm` on cache hits (a decode loop
over a fixed set of batch sizes and 32 layers) and on misses (cache cleared each call), and
the cost through `AllReduceFusion.strategy` (the lookup a layer's reduction makes). Median of 7
repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fusion import AllReduceFusion, FusionConfig, FusionDispatcher, FusionEnvironment, TensorParallelGroup

ENV = FusionEnvironment(enabled=True, backend="torch", world_size=2, hidden_size=4096, dtype=torch.bfloat16, max_tokens=2048)


def time_per_call(fn, keys: list[tuple[int, int]], calls: int, repeats: int = 7) -> float:
    """Median over repeats of seconds per call of fn(layer, bs) cycling through keys."""
    rounds = max(1, calls // len(keys))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            for layer, bs in keys:
                fn(layer, bs)
        samples.append((time.perf_counter() - start) / (rounds * len(keys)))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--batch-sizes", type=int, default=64, help="distinct batch sizes cycled through")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    keys = [(layer, bs) for bs in range(1, args.batch_sizes + 1) for layer in range(32)]
    hit = FusionDispatcher(cache_size=len(keys), environment=ENV)
    for k in keys:
        hit.should_fuse_allreduce_residual_rmsnorm(*k)

    miss = FusionDispatcher(cache_size=64, environment=ENV)

    def uncached(layer: int, bs: int) -> bool:
        miss.cache_clear()
        return miss.should_fuse_allreduce_residual_rmsnorm(layer, bs)

    group = TensorParallelGroup(0, 1, torch.device("cpu"))
    op = AllReduceFusion(group, FusionConfig(enabled=True, backend="torch", cache_size=len(keys)), 4096, torch.bfloat16)
    op.setup()
    results = {
        "cached decision (hit)": time_per_call(hit.should_fuse_allreduce_residual_rmsnorm, keys, args.calls),
        "AllReduceFusion.strategy (hit)": time_per_call(op.strategy, keys, args.calls),
        "decision on a miss (incl. cache_clear)": time_per_call(uncached, keys, args.calls // 10),
    }
    print(f"{'path':42s} {'us/call':>8s}")
    for name, seconds in results.items():
        print(f"{name:42s} {seconds * 1e6:8.3f}")
    print(f"cache_info after hits: {hit.cache_info()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v * 1e6 for k, v in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
