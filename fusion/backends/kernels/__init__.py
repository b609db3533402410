"""Our own Triton kernels over torch symmetric memory. Every one ends with the row step of
`fusion.backends.kernels.row_norm` (one row per program, up to its ``MAX_HIDDEN``)."""
from __future__ import annotations

from typing import Optional


def row_kernel_unavailable_reason(hidden: int, kernel: str) -> Optional[str]:
    """None when Triton imports and a row of ``hidden`` elements fits one program of ``kernel``
    (a name for the message)."""
    try:
        from arfusion.fusion.backends.kernels.row_norm import MAX_HIDDEN
    except ImportError as exc:
        return f"{kernel} needs triton ({exc})"
    if hidden > MAX_HIDDEN:
        return f"hidden {hidden} exceeds {kernel}'s {MAX_HIDDEN} (one row per program)"
    return None
