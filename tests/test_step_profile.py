"""engine/step_profile.py's tables from a profiler trace, without a GPU: a trace of two steps of
CUDA records (and a CPU record, ignored) with known starts and ends gives each kernel's time,
launches and the idle GPU time just before its launches (the gap since the latest end so far;
none before the trace's first record, none for a record that starts while another stream's
still runs), per step, and the kernels ranked by that idle time; with the untraced TPOT, the
step's idle time as it runs untraced (TPOT less the busy time)."""
from types import SimpleNamespace

import torch

from arfusion.engine.step_profile import _kernel_table, format_profile, idle_before, with_tpot

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name: str, start: float, end: float, device=CUDA):
    return SimpleNamespace(name=name, device_type=device, device_time=end - start,
                           time_range=SimpleNamespace(start=start, end=end))


# two steps: norm, gemv (a 3 us gap before it), attn beside a side-stream prefetch, then idle 10 us
TRACE = [_event("norm", 0, 2), _event("gemv", 5, 15), _event("attn", 16, 20), _event("prefetch", 17, 18),
         _event("python", 0, 100, CPU),
         _event("norm", 30, 32), _event("gemv", 35, 45), _event("attn", 46, 50), _event("prefetch", 47, 48)]
PROF = SimpleNamespace(events=lambda: TRACE)


def test_idle_before_each_kernel_is_the_gap_since_the_latest_end():
    assert idle_before(PROF) == {"gemv": 6.0, "attn": 2.0, "norm": 10.0}


def test_the_table_reports_time_launches_and_idle_before_per_step():
    table = _kernel_table(PROF, batch_size=1, steps=2, wall_us=25.0, top=3)
    assert table["gpu_busy_us"] == (2 + 10 + 4 + 1) and table["idle_us"] == 25.0 - 17
    assert table["kernels_per_step"] == 4
    assert [(k["name"], k["us_per_step"], k["calls_per_step"], k["idle_before_us_per_step"])
            for k in table["top_kernels"]] == [("gemv", 10, 1, 3), ("attn", 4, 1, 1), ("norm", 2, 1, 5)]
    assert [(k["name"], k["idle_before_us_per_step"]) for k in table["top_idle_before"]] == \
        [("norm", 5), ("gemv", 3), ("attn", 1)]
    text = format_profile(table, "off")
    assert "idle before    3.0 us  gemv" in text and "idle GPU before the launches of (us/step): 9" in text


def test_the_idle_time_at_tpot_is_the_untraced_step_less_the_busy_time():
    table = with_tpot(_kernel_table(PROF, batch_size=1, steps=2, wall_us=25.0, top=3), tpot_ms=0.020)
    assert table["tpot_us"] == 20.0 and table["idle_at_tpot_us"] == 20.0 - 17
    assert "idle 8 (untraced: TPOT 20 us, idle 3)" in format_profile(table, "off")
