"""Timing a captured CUDA graph: the median over replays of the µs per operation it holds."""
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
