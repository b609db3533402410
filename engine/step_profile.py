"""Where the time of one decode step (or one prefill) goes: GPU kernel time per step, by kernel,
from the torch profiler (CUPTI records the kernels of a replayed CUDA graph one by one), against
the step's wall time from the host. For `engine.bench_one_batch --profile`.

    gpu_busy_us  = sum of kernel durations per step (kernels do not overlap on one stream)
    wall_us      = host time per step (`StaticBatch.decode_greedy`: plan, copies, replay, argmax,
                   token commit, tokens to the host; one step late with overlap)
    idle_us      = wall_us - gpu_busy_us: launch gaps and host work the GPU waits for, plus what
                   tracing itself costs (CUPTI's records: the traced steps take longer than
                   untraced ones)
    idle_at_tpot_us = TPOT of the untraced steps - gpu_busy_us (`with_tpot`): the GPU's idle time
                   in a step as it runs untraced (kernel durations are GPU timestamps, which
                   tracing does not stretch)
    idle before  = per kernel, the GPU's idle time just before its launches start (the gap since
                   the latest end of any earlier record of the trace), per step: where the
                   launch gaps of ``idle_us`` fall (the first record of the trace gets none)
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional

import torch

PROFILE_STEPS = 10  # decode steps traced per batch size (the batch needs PROFILE_STEPS + 2 more tokens of context)


def profile_decode_steps(runner: Any, batch_size: int, input_len: int, vocab: int, seed: int,
                         steps: int = PROFILE_STEPS, top: int = 25, overlap: bool = True) -> dict[str, Any]:
    """Prefill a static batch, then profile ``steps`` greedy decode steps. Returns per-step
    wall, GPU-busy and idle µs, and the ``top`` kernels by time per step."""
    from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts
    from torch.profiler import ProfilerActivity, profile

    batch = StaticBatch(runner, random_prompts(batch_size, input_len, vocab, seed), steps + 2)
    batch.prefill_greedy()
    batch.decode_greedy(1, overlap)  # first replay outside the trace
    torch.cuda.synchronize(runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        batch.decode_greedy(steps, overlap)
        wall_us = (time.perf_counter() - start) * 1e6 / steps
    return _kernel_table(prof, batch_size, steps, wall_us, top)


def profile_prefill(runner: Any, batch_size: int, input_len: int, vocab: int, seed: int,
                    top: int = 25) -> dict[str, Any]:
    """Profile the prefill of a static batch of ``batch_size`` random prompts of ``input_len``
    tokens (one eager forward; the caller has run one of that size before, so no compile or
    allocation is traced). Same fields as `profile_decode_steps`, for one step."""
    from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts
    from torch.profiler import ProfilerActivity, profile

    batch = StaticBatch(runner, random_prompts(batch_size, input_len, vocab, seed), 2)
    torch.cuda.synchronize(runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        batch.prefill_greedy().get()
        wall_us = (time.perf_counter() - start) * 1e6
    return _kernel_table(prof, batch_size, 1, wall_us, top)


def kernel_totals(prof: Any, name_chars: int = 90) -> dict[str, list[float]]:
    """``{kernel name (its first name_chars characters): [GPU µs, launches]}`` summed over a torch
    profiler trace's CUDA records (a replayed CUDA graph's kernels one by one)."""
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            entry = per_kernel[event.name[:name_chars]]
            entry[0] += event.device_time
            entry[1] += 1
    return per_kernel


def idle_before(prof: Any, name_chars: int = 90) -> dict[str, float]:
    """``{kernel name (its first name_chars characters): µs}``: the GPU's idle time just before
    each launch of the kernel, summed over a profiler trace (module docstring). The trace's CUDA
    records in order of their start; a record that starts before the latest end so far (another
    stream's) waited for nothing."""
    records = sorted((event.time_range.start, event.time_range.end, event.name[:name_chars]) for event in prof.events()
                     if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0)
    gaps: dict[str, float] = defaultdict(float)
    latest_end: Optional[float] = None
    for start, end, name in records:
        if latest_end is not None and start > latest_end:
            gaps[name] += start - latest_end
        latest_end = end if latest_end is None else max(latest_end, end)
    return dict(gaps)


def _kernel_table(prof: Any, batch_size: int, steps: int, wall_us: float, top: int) -> dict[str, Any]:
    """Per-step wall, GPU-busy and idle µs, the ``top`` kernels by time of a profiler trace of
    ``steps`` steps with the idle time before their launches, and the ``top`` kernels by that
    idle time."""
    per_kernel = kernel_totals(prof)
    gaps = idle_before(prof)
    busy = sum(total for total, _ in per_kernel.values()) / steps
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    waited = sorted(gaps.items(), key=lambda kv: -kv[1])[:top]
    return {
        "batch_size": batch_size, "steps": steps, "wall_us": wall_us, "gpu_busy_us": busy, "idle_us": wall_us - busy,
        "kernels_per_step": sum(n for _, n in per_kernel.values()) / steps,
        "top_kernels": [{"name": name, "us_per_step": total / steps, "calls_per_step": n / steps,
                         "idle_before_us_per_step": gaps.get(name, 0.0) / steps} for name, (total, n) in ranked],
        "top_idle_before": [{"name": name, "idle_before_us_per_step": gap / steps,
                             "calls_per_step": per_kernel[name][1] / steps} for name, gap in waited],
    }


def with_tpot(p: dict[str, Any], tpot_ms: float) -> dict[str, Any]:
    """A decode profile ``p`` with ``tpot_us`` (the untraced steps' TPOT) and ``idle_at_tpot_us``
    (that TPOT less the traced GPU busy time: the module docstring)."""
    return {**p, "tpot_us": tpot_ms * 1e3, "idle_at_tpot_us": tpot_ms * 1e3 - p["gpu_busy_us"]}


def format_profile(p: dict[str, Any], label: str) -> str:
    at_tpot = (f" (untraced: TPOT {p['tpot_us']:.0f} us, idle {p['idle_at_tpot_us']:.0f})"
               if "idle_at_tpot_us" in p else "")
    lines = [f"[profile {label} bs={p['batch_size']}] wall {p['wall_us']:.0f} us/step, GPU busy {p['gpu_busy_us']:.0f}, "
             f"idle {p['idle_us']:.0f}{at_tpot}, {p['kernels_per_step']:.0f} kernels/step"]
    lines += [f"  {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  idle before {k['idle_before_us_per_step']:6.1f} us"
              f"  {k['name']}" for k in p["top_kernels"]]
    lines.append(f"  idle GPU before the launches of (us/step): {sum(k['idle_before_us_per_step'] for k in p['top_idle_before']):.0f}"
                 f" among the {len(p['top_idle_before'])} kernels it is largest before")
    lines += [f"  {k['idle_before_us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['name']}" for k in p["top_idle_before"]]
    return "\n".join(lines)
