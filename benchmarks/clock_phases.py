"""Summarise an ``nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,
temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms N`` log: for each GPU,
the busy stretches (power above ``--busy-watts``) cut into windows of ``--window-s`` seconds,
each with its median SM clock, median power and whether the software power cap (throttle bit
0x4) was active. Shows whether a benchmark phase ran power-capped.

    python -m arfusion.benchmarks.clock_phases clocks.csv --window-s 0.5
"""
from __future__ import annotations

import argparse
import csv
import statistics
from datetime import datetime
from typing import Optional, Sequence

POWER_CAP_BIT = 0x4  # clocks_throttle_reasons: SW power cap


def read_samples(path: str) -> dict[str, list[tuple[float, float, float, int]]]:
    """``{gpu index: [(seconds, SM MHz, watts, throttle bits)]}`` from the CSV (bad rows skipped)."""
    samples: dict[str, list[tuple[float, float, float, int]]] = {}
    for row in csv.reader(open(path)):
        try:
            stamp = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.setdefault(row[1].strip(), []).append(
                (stamp, float(row[2].split()[0]), float(row[4].split()[0]), int(row[6].strip(), 16)))
        except (IndexError, ValueError):
            continue
    return samples


def windows(samples: list[tuple[float, float, float, int]], busy_watts: float, window_s: float) -> list[str]:
    """One line per window of consecutive busy samples: start offset, median clock and power,
    the fraction of samples under the power cap."""
    lines, current = [], []
    start = samples[0][0] if samples else 0.0

    def flush() -> None:
        if current:
            t0 = current[0][0] - start
            capped = sum(1 for s in current if s[3] & POWER_CAP_BIT) / len(current)
            lines.append(f"  t={t0:7.2f}s  SM {statistics.median(s[1] for s in current):5.0f} MHz  "
                         f"{statistics.median(s[2] for s in current):4.0f} W  power-capped {capped:4.0%}")
            current.clear()

    for s in samples:
        if s[2] < busy_watts or (current and s[0] - current[0][0] >= window_s):
            flush()
        if s[2] >= busy_watts:
            current.append(s)
    flush()
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--busy-watts", type=float, default=200.0)
    p.add_argument("--window-s", type=float, default=0.5)
    p.add_argument("--gpu", default="0")
    args = p.parse_args(argv)
    samples = read_samples(args.csv).get(args.gpu, [])
    print(f"gpu {args.gpu}: {len(samples)} samples")
    print("\n".join(windows(samples, args.busy_watts, args.window_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
