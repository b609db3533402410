"""Timing the fused op the way it runs in an engine: captured in one CUDA graph and replayed
(the tuner's measurement; `median_us_eager` where there is no GPU)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def capture_cuda_graph(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, outputs)``: ``step()`` run once eagerly on a side stream (lazy init, Triton and
    JIT compilation stay outside the capture), then captured; ``outputs`` is what the captured
    call returned (static tensors that each replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def median_replay_us(graph: torch.cuda.CUDAGraph, calls_per_replay: int, replays: int = 10) -> float:
    """Median over ``replays`` replays of ``graph``, each timed with CUDA events, of its time
    divided by ``calls_per_replay``, in µs."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / calls_per_replay)
    return statistics.median(samples)


def median_us_per_call(calls: Callable[[], None], calls_per_graph: int, warmup: int = 3, trials: int = 10) -> float:
    """``calls()`` issues ``calls_per_graph`` calls: captured by `capture_cuda_graph`, replayed
    ``warmup`` times, then `median_replay_us` of ``trials`` replays: the median µs of one call."""
    graph, _ = capture_cuda_graph(calls)
    for _ in range(warmup):
        graph.replay()
    return median_replay_us(graph, calls_per_graph, trials)


def median_us_eager(calls: Callable[[], None], calls_per_run: int, warmup: int = 3, trials: int = 10) -> float:
    """The same measurement without a GPU: ``calls()`` run eagerly, timed with the host clock."""
    for _ in range(warmup):
        calls()
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        calls()
        samples.append((time.perf_counter() - start) * 1e6 / calls_per_run)
    return statistics.median(samples)
