"""Arrival counters for launches whose programs finish a group's work together: each program of a
group writes its part, then (after a CTA barrier) adds one to the group's int32 counter with
release/acquire semantics at GPU scope; the program that sees the group's last count reads the
others' parts (past L1: ``cache_modifier=".cg"``), finishes the group, and sets the counter back
to zero for the next launch. Which program arrives last varies; what it computes does not.

`ArrivalCounters` keeps one zeroed buffer per device for one owner (a kernel family), so that
two kernel families never share a counter. A CUDA graph captures the buffer's address, so a
buffer is never freed while the process runs, and a larger one cannot be made during capture."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


class ArrivalCounters:
    """Per device, the zeroed int32 counters of ``owner``'s launches (module docstring): at least
    ``minimum`` of them, more when a call needs more."""

    def __init__(self, owner: str, minimum: int = 1 << 16) -> None:
        self.owner = owner
        self.minimum = minimum
        self.by_device: dict[torch.device, torch.Tensor] = {}
        self.outgrown: list[torch.Tensor] = []  # replaced by larger ones: kept, a captured CUDA graph may hold them

    def get(self, device: torch.device, count: int) -> torch.Tensor:
        """The device's counters (zero between calls) for a launch of ``count`` groups; a larger
        buffer is made when a call needs more (the smaller one stays allocated), which a CUDA
        graph capture cannot do (RuntimeError naming the sizes: run the shape once before)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        counters = self.by_device.get(device)
        if counters is None or counters.numel() < count:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.owner}: a launch of {count} groups needs more arrival counters than the "
                                   f"{0 if counters is None else counters.numel()} made so far, which cannot be "
                                   "allocated during CUDA graph capture; run the shape once before capturing")
            if counters is not None:
                self.outgrown.append(counters)
            counters = torch.zeros(max(count, self.minimum), dtype=torch.int32, device=device)
            self.by_device[device] = counters
        return counters


@triton.jit
def last_to_arrive(Arrivals, index, count):
    """Whether this program is the ``count``-th (last) of its group to arrive at counter ``index``
    (module docstring): every thread's stores before the arrival (a CTA barrier, then the count's
    release); the last program's later reads see the others' stores (acquire; read them past L1,
    ``cache_modifier=".cg"``) and it sets the counter back to zero for the next launch."""
    tl.debug_barrier()
    arrived = tl.atomic_add(Arrivals + index, 1, sem="acq_rel", scope="gpu")
    last = arrived == count - 1
    if last:
        tl.atomic_xchg(Arrivals + index, 0, sem="relaxed", scope="gpu")
    return last
