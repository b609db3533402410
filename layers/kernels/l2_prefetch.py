"""A weight brought into the GPU's L2 cache while other launches run, ahead of the launch that
reads it (``--prefetch-o-proj``: the attention output projection's weight during a decode
step's rotary and attention launches).

    prefetch_l2(t)     one launch: lane i of a one-warp program issues sm90's bulk prefetch
                       ``cp.async.bulk.prefetch.L2.global [t + i * CHUNK], size`` (size = CHUNK,
                       the last chunk t's remaining bytes rounded down to 16); no registers are
                       filled and no value is written: the program exits once its requests are
                       issued, and the SM's TMA unit moves the bytes from HBM into L2.
    ahead(t)           a context: on entry ``prefetch_l2(t)`` on a side stream that first waits
                       for the current stream's launches so far; on exit the current stream
                       waits for that launch. The launches inside the block run on the current
                       stream meanwhile: in a CUDA graph the prefetch is a branch beside them.

Why: at decode the attention's launches (rotary and KV write, the split launch and its combine)
read a few sequences' keys and values and are bound by latency, not bandwidth, for several
microseconds, while the o projection after them streams its weight (17-34 MB for the models
here, less than L2's 50 MB on an H100 or H200) from HBM in a launch too short to reach full
bandwidth (docs/results.md, "Decode at the weight floor"). Read from L2 instead, that launch
waits less on memory. torch has no L2 prefetch of its own, and CUDA's access policy windows
(persisting L2 lines) would set a share of L2 aside for the process and keep lines there beyond
the one read that needs them; a prefetch needs neither. It is a hint: values never change, only
where the next read finds them.

`prefetch_refusal` says why a tensor cannot be prefetched (not on a CUDA device of compute
capability 9.0 or newer, not contiguous, its address not 16-byte aligned, triton missing);
`ahead` then runs its block alone and logs the reason once per process.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from arfusion.layers.kernels.triton_support import triton_available

logger = logging.getLogger(__name__)
CHUNK = 64 * 1024  # bytes one bulk prefetch requests
LANES = 32  # chunks a one-warp program issues
_LOGGED: set[str] = set()  # the reasons logged so far (a fixed handful)
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def device_refusal(device: torch.device) -> Optional[str]:
    """Why no tensor on ``device`` can be prefetched, or None."""
    if device.type != "cuda":
        return f"a {device.type} tensor"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "a GPU older than sm90 (no bulk prefetch)"
    if not triton_available():
        return "triton is not installed"
    return None


def prefetch_refusal(t: torch.Tensor) -> Optional[str]:
    """Why `prefetch_l2` does not take ``t``, or None."""
    reason = device_refusal(t.device)
    if reason is not None:
        return reason
    if not t.is_contiguous() or t.data_ptr() % 16:
        return "a tensor not contiguous or not 16-byte aligned"
    return None


def prefetch_l2(t: torch.Tensor) -> None:
    """Issue bulk L2 prefetches of ``t``'s bytes (module docstring) on the current stream; ``t``
    is not changed. ValueError naming the problem where `prefetch_refusal` refuses it."""
    reason = prefetch_refusal(t)
    if reason is not None:
        raise ValueError(f"cannot prefetch {reason} into L2")
    issue_prefetch(t)


def issue_prefetch(t: torch.Tensor) -> None:
    """The launch of `prefetch_l2` for a ``t`` its caller has checked with `prefetch_refusal`."""
    from arfusion.layers.kernels.triton_l2_prefetch import launch_prefetch

    launch_prefetch(t.view(torch.uint8).reshape(-1), t.numel() * t.element_size(), CHUNK, LANES)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@contextmanager
def ahead(t: torch.Tensor) -> Iterator[None]:
    """The prefetch of ``t`` on a side stream beside the block's launches, joined on exit (module
    docstring); where `prefetch_refusal` refuses ``t``, the block alone and the reason logged
    once."""
    reason = prefetch_refusal(t)
    if reason is not None:
        if reason not in _LOGGED:
            _LOGGED.add(reason)
            logger.info("L2 prefetch: %s runs without it", reason)
        yield
        return
    current = torch.cuda.current_stream(t.device)
    side = _side_stream(t.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        issue_prefetch(t)
    try:
        yield
    finally:
        current.wait_stream(side)
