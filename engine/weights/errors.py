"""`ModelFileError`: a model file that cannot be served, and `finite_cast`, the check every loaded
tensor passes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch


class ModelFileError(ValueError):
    """A model file that cannot be served. ``str()`` is one line, ``"<file>: <problem>"``; ``path``
    and ``problem`` are kept apart. A ValueError: the launcher exits 2 on it without a traceback."""

    def __init__(self, path: Union[str, Path], problem: str) -> None:
        self.path = str(path)
        self.problem = " ".join(str(problem).split())  # one line, whatever a library's message held
        super().__init__(f"{self.path}: {self.problem}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # picklable with its two arguments
        return type(self), (self.path, self.problem)


def truncation(size: int, ends: list[tuple[int, str]]) -> Optional[str]:
    """The problem of a file of ``size`` bytes whose tensors end at the given byte offsets
    (``(end, tensor name)``), or None when all of them lie inside it."""
    past = sorted((end, name) for end, name in ends if end > size)
    if not past:
        return None
    return (f"truncated: the file has {size} bytes, its tensor data needs {past[-1][0]} "
            f"({len(past)} of {len(ends)} tensors end past the end, the first {past[0][1]!r})")


def finite_cast(tensor: torch.Tensor, dtype: torch.dtype, name: str, path: Union[str, Path]) -> torch.Tensor:
    """``tensor.to(dtype)`` (a new tensor unless the dtype already matches), checked to hold only
    finite values when ``dtype`` is a floating type; an integer tensor (MXFP4 blocks and scales)
    is returned as it is. `ModelFileError` naming the file and the
    tensor: how many values of the file are NaN or infinite, or, when the file's values are
    finite, how many exceed the range of ``dtype``."""
    if not tensor.is_floating_point():
        return tensor
    out = tensor.to(dtype)
    if not out.is_floating_point() or bool(torch.isfinite(out).all()):
        return out
    bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
    if bad:
        nans = int(torch.isnan(tensor).sum())
        raise ModelFileError(path, f"tensor {name!r} has non-finite weights: {nans} NaN and {bad - nans} infinite "
                                   f"values among its {tensor.numel()}")
    overflow = int((~torch.isfinite(out)).sum())
    raise ModelFileError(path, f"tensor {name!r}: {overflow} of {tensor.numel()} values exceed the range of "
                               f"{str(dtype).removeprefix('torch.')} (max |w| {tensor.abs().max().item():.3g}); "
                               "load it in a wider --dtype")
