"""Micro-benchmark: the cost of one cached fusion decision in eager Python (CPU).

    python -m arfusion.benchmarks.bench_dispatch_overhead [--calls 1000000] [--batch-sizes 64]
    python -m arfusion.benchmarks.bench_dispatch_overhead --layers 8 --tp 2 [--tokens 4]

Times `AllReduceFusion.should_fuse_allreduce_residual_rmsnorm` (the public decision) and
`AllReduceFusion.strategy` (the lookup each reduction makes) on cache hits, for one key and in a
decode loop over 32 layers x ``--batch-sizes`` batch sizes, and the decision on a miss (cache
cleared each call) over a TP2 plan whose backends all fit. Median of 7 repeats, less the cost of
the same loop calling a no-op Python function (printed as the baseline).

With ``--layers``: the Python calls into fusion/ and the µs (Python and norm math, the collective
a no-op) per decoder layer of a stack of layers' reductions at TP ``--tp`` on CPU
(`benchmarks.layer_overhead`).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from arfusion.fusion import AllReduceFusion, FusionConfig, Strategy, TensorParallelGroup
from arfusion.fusion.backends.base import Rows
from arfusion.fusion.dispatch.decision import DispatchPlan, ModelShape
from arfusion.fusion.dispatch.table import StrategyTable


class AnyRows:
    """A backend that runs every batch (the plan only asks ``rows``)."""

    def rows(self) -> Rows:
        return Rows(1, None)


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
    parser.add_argument("--layers", type=int, help="measure a stack of this many decoder layers' reductions instead")
    parser.add_argument("--tp", type=int, default=2, help="with --layers: TP ranks (gloo, CPU)")
    parser.add_argument("--tokens", type=int, default=4, help="with --layers: tokens per forward")
    args = parser.parse_args()
    if args.layers:
        from arfusion.benchmarks.layer_overhead import measure

        result = measure(args.layers, args.tp, args.tokens)
        print(f"{args.layers} layers, TP{args.tp}, {args.tokens} tokens, torch backend: "
              f"{result['calls_per_layer']:.2f} Python calls into fusion/ per layer, "
              f"{result['us_per_layer']:.2f} us per layer, Python and norm math (median; min {result['us_per_layer_min']:.2f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return

    keys = [(layer, bs) for bs in range(1, args.batch_sizes + 1) for layer in range(32)]
    logging.getLogger("arfusion.fusion").setLevel(logging.ERROR)  # TP1: "runs unfused" is expected here
    group = TensorParallelGroup(0, 1, torch.device("cpu"))
    op = AllReduceFusion(group, FusionConfig(enabled=True, backend="torch", cache_size=len(keys)), 4096, torch.bfloat16)
    op.setup()
    for k in keys:
        op.should_fuse_allreduce_residual_rmsnorm(*k)

    table = StrategyTable((1, 4096), ({Strategy.NCCL: 9.0, Strategy.FLASHINFER_ONE_SHOT: 4.0},
                                      {Strategy.NCCL: 200.0, Strategy.SYMM_MEM_FUSED: 150.0}))
    miss = DispatchPlan(ModelShape(2, 4096, torch.bfloat16), {s: AnyRows() for s in Strategy if s is not Strategy.TORCH},
                        table, None, cache_size=64)

    def uncached(layer: int, bs: int) -> bool:
        miss.strategy.cache_clear()
        return miss.should_fuse_allreduce_residual_rmsnorm(layer, bs)

    def noop(layer: int, bs: int) -> bool:
        return False

    baseline = {"one key": time_per_call(noop, keys[:1], args.calls), "loop": time_per_call(noop, keys, args.calls)}
    results = {
        "should_fuse hit, one key": time_per_call(op.should_fuse_allreduce_residual_rmsnorm, keys[:1], args.calls)
        - baseline["one key"],
        f"should_fuse hit, {len(keys)}-key loop": time_per_call(op.should_fuse_allreduce_residual_rmsnorm, keys,
                                                                args.calls) - baseline["loop"],
        f"strategy hit, {len(keys)}-key loop": time_per_call(op.strategy, keys, args.calls) - baseline["loop"],
        "decision on a miss (incl. cache_clear)": time_per_call(uncached, keys, args.calls // 10) - baseline["loop"],
    }
    print(f"baseline (a no-op call in the same loop): {baseline['one key'] * 1e6:.3f} us one key, "
          f"{baseline['loop'] * 1e6:.3f} us loop; subtracted below")
    print(f"{'path':44s} {'us/call':>8s}")
    for name, seconds in results.items():
        print(f"{name:44s} {seconds * 1e6:8.3f}")
    print(f"cache_info after the hits: {op.cache_info()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v * 1e6 for k, v in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
