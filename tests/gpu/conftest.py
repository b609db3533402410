"""GPU tests declare the CUDA GPUs they need with a marker, on the test or on the module:

    @pytest.mark.gpus(1)                   one device: kernels, the TP1 model
    @pytest.mark.tp_ranks(N)               a collective test of N TP ranks (N = gpu_world_size():
                                           ARFUSION_GPU_WORLD, default 2): one GPU per rank when
                                           there are N, else the ranks share the GPUs there are
                                           (the TP group's shared-GPU mode: correct, not timed)
    @pytest.mark.gpus(2, reason="...")     a test whose subject is two physical GPUs (a peer
                                           that faults on its own device, timing thresholds)

A test needing more GPUs than are visible is skipped with "needs N CUDA GPUs, found M" (and the
marker's reason); a ``tp_ranks`` test needs one. On a machine without a GPU every test here is
skipped. A test under tests/gpu without a marker fails (it would otherwise run on a machine it
may not fit).
"""
from pathlib import Path

import pytest
import torch

GPU_TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n, reason=None): the test needs n CUDA GPUs; skipped when fewer are visible")
    config.addinivalue_line("markers", "tp_ranks(n): a collective test of n TP ranks; they share GPUs when fewer are visible")


def _marker_count(item, name: str) -> int | None:
    """N of the item's ``name(N)`` marker; None when it has none or a malformed one."""
    marker = item.get_closest_marker(name)
    if marker is None or len(marker.args) != 1 or not isinstance(marker.args[0], int) or marker.args[0] < 1:
        return None
    return marker.args[0]


def _needed_gpus(item) -> int | None:
    """The GPUs the item needs: N of ``gpus(N)``, 1 for ``tp_ranks(N)``; None without a marker."""
    if _marker_count(item, "tp_ranks") is not None:
        return 1
    return _marker_count(item, "gpus")


def pytest_collection_modifyitems(config, items):
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if not Path(item.path).resolve().is_relative_to(GPU_TESTS):
            continue  # this hook sees every collected test, not only ours
        needed = _needed_gpus(item)
        if needed is not None and needed > found:
            why = item.get_closest_marker("gpus").kwargs.get("reason") if needed > 1 else None
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPUs, found {found}" + (f": {why}" if why else "")))


def pytest_runtest_setup(item):
    """(Runs for tests under this directory only.) Fails a test that does not declare its GPUs."""
    if _needed_gpus(item) is None:
        pytest.fail(f"{item.nodeid}: a tests/gpu test must declare the GPUs it needs with @pytest.mark.gpus(N) or "
                    "@pytest.mark.tp_ranks(N), N >= 1", pytrace=False)
