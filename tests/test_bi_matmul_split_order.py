"""The batch-invariant matmul's K splits summed in split order by the tile's last program, bit
for bit against their definition (tests/bi_matmul_split_check.py), under Triton's CPU interpreter
in a spawned child; skipped without triton."""
import pytest

from tests.dist_utils import run_under_triton_interpreter


def _interpreted(rank: int, world: int) -> list:
    import torch

    from tests.bi_matmul_split_check import split_sum_mismatches

    return split_sum_mismatches(torch.device("cpu"))


@pytest.mark.timeout(300)
def test_split_partials_are_summed_in_order_by_the_last_program():
    pytest.importorskip("triton")
    assert run_under_triton_interpreter(_interpreted, timeout_s=240) == []


def test_outgrown_arrival_counters_stay_allocated():
    """A larger counter buffer replaces the device's, and the smaller one is kept alive (a CUDA
    graph captured on it would otherwise launch on freed memory); both start at zero."""
    import torch

    from arfusion.layers.kernels.arrival_counters import ArrivalCounters

    counters = ArrivalCounters("a test", minimum=16)
    device = torch.device("cpu")
    small = counters.get(device, 10)
    assert small.numel() == 16 and counters.get(device, 5) is small
    large = counters.get(device, 17)
    assert large.numel() == 17 and not large.any()
    assert counters.outgrown == [small] and counters.get(device, 3) is large
