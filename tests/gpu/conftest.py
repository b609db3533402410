"""GPU tests declare the CUDA GPUs they need with a marker, on the test or on the module:

    @pytest.mark.gpus(1)                   one device: kernels, the TP1 model
    @pytest.mark.gpus(2)                   a test that starts exactly two ranks itself
    pytestmark = pytest.mark.gpus(gpu_world_size())
                                           collective tests spawned over the GPU world:
                                           ARFUSION_GPU_WORLD ranks (default 2; 4 or 8 on bigger hosts)

A test needing more GPUs than are visible is skipped with "needs N CUDA GPUs, found M": on a
machine without a GPU every test here is skipped, on one GPU only the single-device tests run.
A test under tests/gpu without the marker fails (it would otherwise run on a machine it may not
fit).
"""
from pathlib import Path

import pytest
import torch

GPU_TESTS = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): the test needs n CUDA GPUs; skipped when fewer are visible")


def _needed_gpus(item) -> int | None:
    """N of the item's ``gpus(N)`` marker; None when it has none or a malformed one."""
    marker = item.get_closest_marker("gpus")
    if marker is None or len(marker.args) != 1 or not isinstance(marker.args[0], int) or marker.args[0] < 1:
        return None
    return marker.args[0]


def pytest_collection_modifyitems(config, items):
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if not Path(item.path).resolve().is_relative_to(GPU_TESTS):
            continue  # this hook sees every collected test, not only ours
        needed = _needed_gpus(item)
        if needed is not None and needed > found:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPUs, found {found}"))


def pytest_runtest_setup(item):
    """(Runs for tests under this directory only.) Fails a test that does not declare its GPUs."""
    if _needed_gpus(item) is None:
        pytest.fail(f"{item.nodeid}: a tests/gpu test must declare the GPUs it needs with @pytest.mark.gpus(N), "
                    "N >= 1", pytrace=False)
