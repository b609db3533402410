"""What this process's hardware and installation can run, asked once and cached."""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

# Bytes one vectorised access moves in the trtllm kernels: hidden * itemsize must be a multiple.
KERNEL_ACCESS_BYTES = 16
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def flashinfer_import_error() -> Optional[str]:
    """None when ``flashinfer.comm`` imports, else why it does not."""
    try:
        importlib.import_module("flashinfer.comm")
    except Exception as exc:  # any failure to import means: no flashinfer path
        return f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return None


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def is_capturing_cuda_graph() -> bool:
    """True while the current stream is capturing a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def hidden_alignment_error(hidden: int, dtype: torch.dtype) -> Optional[str]:
    """None when ``hidden`` elements of ``dtype`` are a whole number of 16-byte accesses."""
    row_bytes = hidden * dtype.itemsize
    if row_bytes % KERNEL_ACCESS_BYTES:
        return (
            f"hidden size {hidden} x {dtype} is {row_bytes} bytes per token, not a multiple of "
            f"{KERNEL_ACCESS_BYTES} bytes as the fused kernel needs"
        )
    return None
