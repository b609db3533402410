"""Shared pieces of the Triton attention kernels' interpreter tests (decode and extend)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

PAD_SLOT = 10**9  # what pads a row past seq_len: far outside any cache, so reading it would fail


def spread_rows(req_to_token: torch.Tensor, spare: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, row_ids)``: the B rows of req_to_token at random distinct rows of a table of
    B + spare rows, whose other rows hold PAD_SLOT (reading them would fail)."""
    g = torch.Generator().manual_seed(seed)
    batch, context = req_to_token.shape
    row_ids = torch.randperm(batch + spare, generator=g)[:batch].to(req_to_token.dtype)
    table = torch.full((batch + spare, context), PAD_SLOT, dtype=req_to_token.dtype)
    table[row_ids.long()] = req_to_token
    return table, row_ids


def result_checker(results: dict[Any, Optional[str]]) -> Callable[..., None]:
    """``check(key, actual, expected, rtol, atol)``: records None under ``key`` when
    ``torch.testing.assert_close`` passes, else its message (the interpreter child returns
    ``results`` to the parametrized tests)."""
    def check(key: Any, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
            results[key] = None
        except AssertionError as e:
            results[key] = str(e)

    return check
