"""The o projection's decode-sized launch reading its weight from HBM against from L2 after
`layers.kernels.l2_prefetch.ahead` (``--prefetch-o-proj``), bf16, at the o projections of
llama3-8b, qwen3-30b-a3b and gpt-oss (TP1; sm90 or newer).

Each measured call stands for a decode layer's tail: a busy-wait of ``--window-us`` (the rotary
and attention launches, which read little), then `skinny_linear` of one of a cycle of distinct
weight copies of at least 256 MB in all (no weight left in L2 by an earlier call). Three CUDA
graphs of those calls, µs per call (median of 10 replays):

    wait alone            the busy-wait only
    from HBM              the busy-wait, then the launch
    prefetched            the busy-wait inside ``ahead(weight)`` (the prefetch on a side stream
                          beside it), then the launch

The launch's time is each row minus the wait alone; the share is the weight's bytes at 4.8 TB/s
over that time. ``ratio`` = prefetched / from HBM.

    python -m arfusion.benchmarks.kernels.bench_l2_prefetch --tokens 1 8 --window-us 8 --out out/l2.json
"""
from __future__ import annotations

import argparse

import torch

from arfusion.benchmarks.kernels.bench_skinny_matmul import HBM_BYTES_PER_US, cycled_weights
from arfusion.benchmarks.kernels.rows_file import write_rows
from arfusion.fusion.tuning.timing import median_us_per_call

SHAPES = [("llama3-8b", 4096, 4096), ("qwen3-30b-a3b", 2048, 4096), ("gpt-oss", 2880, 4096)]  # (model, N, K)


def sleep_cycles_per_us() -> float:
    """The busy-wait kernel's clock cycles per µs on this GPU, timed with CUDA events."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def main() -> None:
    from arfusion.layers.kernels.l2_prefetch import ahead, prefetch_refusal
    from arfusion.layers.kernels.triton_skinny_matmul import skinny_linear

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--window-us", type=float, default=8.0, help="the busy-wait before each launch (default: 8)")
    parser.add_argument("--out")
    args = parser.parse_args()
    window = int(args.window_us * sleep_cycles_per_us())
    rows = []
    print(f"{'model':>14} {'N':>6} {'K':>6} {'M':>3} {'wait us':>8} {'HBM us':>8} {'%BW':>5} {'L2 us':>8} {'%BW':>5}"
          f" {'ratio':>6}")
    for model, n, k in SHAPES:
        nbytes = n * k * 2
        weights = cycled_weights(n, k)
        refusal = prefetch_refusal(weights[0])
        if refusal is not None:
            raise SystemExit(f"cannot prefetch {refusal} into L2")
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def prefetched(w: torch.Tensor) -> None:
                with ahead(w):
                    torch.cuda._sleep(window)
                skinny_linear(x, w)

            prefetched(weights[0])  # the side stream and the launches exist before capture
            calls = len(weights)
            wait = median_us_per_call(lambda: [torch.cuda._sleep(window) for _ in weights], calls)
            hbm = median_us_per_call(lambda: [(torch.cuda._sleep(window), skinny_linear(x, w)) for w in weights], calls)
            l2 = median_us_per_call(lambda: [prefetched(w) for w in weights], calls)
            hbm_us, l2_us = hbm - wait, l2 - wait
            print(f"{model:>14} {n:>6} {k:>6} {m:>3} {wait:>8.2f} {hbm_us:>8.2f} "
                  f"{100 * nbytes / hbm_us / HBM_BYTES_PER_US:>4.0f}% {l2_us:>8.2f} "
                  f"{100 * nbytes / l2_us / HBM_BYTES_PER_US:>4.0f}% {l2_us / hbm_us:>6.2f}")
            rows.append(dict(model=model, n=n, k=k, tokens=m, window_us=args.window_us, wait_us=wait,
                             hbm_us=hbm_us, prefetched_us=l2_us))
        weights.clear()
        torch.cuda.empty_cache()
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
