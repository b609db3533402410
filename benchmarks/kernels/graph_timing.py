"""Timing a captured CUDA graph: the median over replays of the µs per operation it holds, and
the GPU time of each of its kernels per operation."""
import statistics

import torch


def median_replay_us(graph: torch.cuda.CUDAGraph, ops_per_replay: int, replays: int = 10) -> float:
    """Median over ``replays`` replays of ``graph`` (each timed by CUDA events and synchronized)
    of its time divided by ``ops_per_replay``, in µs."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ops_per_replay)
    return statistics.median(times)


def kernel_us_per_op(graph: torch.cuda.CUDAGraph, ops_per_replay: int, replays: int = 3) -> dict[str, float]:
    """GPU time of each kernel of ``graph`` (by name, the profiler's CUPTI records of the replayed
    kernels), summed over ``replays`` replays and divided by ``replays * ops_per_replay``, in µs,
    largest first."""
    from torch.profiler import ProfilerActivity, profile

    from arfusion.engine.step_profile import kernel_totals

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals = kernel_totals(prof, name_chars=60)
    return {name: us / (replays * ops_per_replay) for name, (us, _) in sorted(totals.items(), key=lambda kv: -kv[1][0])}
