"""Timing GPU work the way it runs in an engine: captured in one CUDA graph and replayed."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_us_per_call(calls: Callable[[], None], calls_per_graph: int, warmup: int = 3, trials: int = 10) -> float:
    """``calls()`` issues ``calls_per_graph`` calls: run once eagerly on a side stream (lazy
    init, compilation), capture it in a CUDA graph, replay ``warmup`` times, then time
    ``trials`` replays with CUDA events. Returns the median µs of one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / calls_per_graph)
    return statistics.median(samples)
