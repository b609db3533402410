"""Deciding together: a step that may fail on one rank, then agreement over the CPU group, so
that every rank goes on or falls back together (never one rank waiting on another)."""
from __future__ import annotations

from typing import Callable, Optional

from arfusion.fusion.group import TensorParallelGroup


def voted_failure(group: TensorParallelGroup, step: Callable[[], Optional[str]]) -> Optional[str]:
    """Run ``step`` (this rank's reason not to go on, or None) here, then gather every rank's
    over the CPU group. Returns None when no rank has a reason, else "rank r: why; ..." naming
    each failing rank (identical on every rank). An exception in ``step`` is this rank's reason."""
    try:
        reason = step()
    except Exception as exc:  # a failure of any kind must reach the other ranks
        reason = f"{type(exc).__name__}: {exc}"
    reasons = group.all_gather_object(reason)
    return "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why) or None
