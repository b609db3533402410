"""`LaunchConfig`: what every TP process of a launch needs, as plain values (the launcher derives
it from the server options: `engine.launch_config`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from arfusion.engine.runtime.model_runner import RunnerSettings
from arfusion.layers.parallel_state import default_device


@dataclass(frozen=True)
class LaunchConfig:
    tp_size: int
    nnodes: int
    node_rank: int
    init_method: str
    device_type: str  # "cuda" or "cpu"
    dist_timeout: float
    log_level: str
    runner: RunnerSettings
    threads_per_rank: int

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)

    def device_for(self, rank: int) -> torch.device:
        """``rank``'s device: its local index modulo the visible GPUs (more ranks per node than
        GPUs share them: the TP group detects it and runs in its shared-GPU mode)."""
        if self.device_type == "cuda":
            return default_device(rank % self.ranks_per_node)
        return torch.device("cpu")
