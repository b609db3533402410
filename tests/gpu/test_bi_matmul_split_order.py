"""On one GPU: the batch-invariant matmul's K splits, summed in split order by whichever program
of a tile arrives last, give the definition's bits (tests/bi_matmul_split_check.py) in each of 50
repeats (the arrival order varies; the result must not), and leave the arrival counters at zero."""
import pytest
import torch

pytest.importorskip("triton")

from tests.bi_matmul_split_check import split_sum_mismatches  # noqa: E402

pytestmark = pytest.mark.gpus(1)


def test_split_partials_are_summed_in_order_by_the_last_program():
    assert split_sum_mismatches(torch.device("cuda", 0), repeats=50) == []
