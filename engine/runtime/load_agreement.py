"""Loading the model on every TP rank and failing together: `load_together`.

Every rank reads the same files, and a model that cannot be served (a `ModelFileError`, or any
ValueError of a configuration that cannot run) fails on each rank wherever its load finds the
problem: a NaN in the last tensor is found only after all the others were loaded. So that no
rank is left waiting in a later collective for a peer that gave up, `load_together` runs one
rank's load and then one all-gather over the CPU group: if the load failed on any rank, every
rank raises `LoadRefused` with the message of the lowest failing rank. A TP worker exits on it
with `REFUSED_EXIT_CODE` and says nothing (rank 0 prints the message, once, and exits with the
same code: the launcher's exit code for a configuration that cannot run).
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")
REFUSED_EXIT_CODE = 2


class LoadRefused(ValueError):
    """The model was refused on some rank of the TP group; raised on every rank."""


def load_together(group: Any, load: Callable[[], T]) -> T:
    """``load()`` on this rank, then a collective over ``group`` (a `fusion.TensorParallelGroup`):
    its result when it succeeded on every rank, else `LoadRefused` on every rank (module
    docstring), chained to this rank's own error when it had one. Other exceptions propagate
    from the rank that raised them, before the collective."""
    try:
        result, error = load(), None
    except ValueError as exc:
        result, error = None, exc
    messages = group.all_gather_object(None if error is None else str(error))
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        rank, message = failed[0]
        raise LoadRefused(message if rank == group.rank else f"TP rank {rank}: {message}") from error
    return result  # type: ignore[return-value]
