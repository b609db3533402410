"""GPU tests need ARFUSION_GPU_WORLD CUDA GPUs (default 2) and flashinfer; without them every
test here is skipped."""
import pytest
import torch

from tests.dist_utils import gpu_world_size


def pytest_collection_modifyitems(config, items):
    world = gpu_world_size()
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return
    skip = pytest.mark.skip(reason=f"needs {world} CUDA GPUs")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
