"""The backends: one object per strategy, owning the resource it runs on (a flashinfer workspace,
a symmetric buffer, nothing for NCCL and the torch reference). The contract: `base.Backend`."""
from __future__ import annotations

from fusion.backends.base import Backend
from fusion.backends.flashinfer import FlashInferOneShotBackend, FlashInferTwoShotBackend
from fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace
from fusion.backends.lamport_one_shot import LamportOneShotBackend
from fusion.backends.reduce_then_norm import NcclBackend, TorchBackend
from fusion.backends.symm_mem import SymmMemTwoShotBackend
from fusion.backends.symm_mem_fused import SymmMemFusedBackend
from fusion.backends.deterministic import allowed
from fusion.group import TensorParallelGroup
from fusion.strategy import Strategy

# made only when a measured table or the rule picks them (each holds a symmetric buffer)
ON_DEMAND = (Strategy.SYMM_MEM_TWO_SHOT, Strategy.SYMM_MEM_FUSED, Strategy.LAMPORT_ONE_SHOT)


def build_backends(group: TensorParallelGroup, backend: str, launch_with_pdl: bool,
                   deterministic: bool = False) -> dict[Strategy, Backend]:
    """Every backend the fusion ``backend`` option ("flashinfer" or "torch") offers on ``group``,
    none ensured yet (no collective). The two flashinfer backends share one workspace. With
    ``deterministic``, only the strategies `fusion.backends.deterministic.allowed` at this world size,
    each following the canonical recipe."""
    backends: dict[Strategy, Backend] = {Strategy.NCCL: NcclBackend(group, deterministic)}
    if backend == "torch":
        backends[Strategy.TORCH] = TorchBackend(group, deterministic)
        return backends
    workspace = AllReduceFusionWorkspace(group)  # no resource until ensured
    backends[Strategy.FLASHINFER_ONE_SHOT] = FlashInferOneShotBackend(group, workspace, launch_with_pdl)
    backends[Strategy.FLASHINFER_TWO_SHOT] = FlashInferTwoShotBackend(group, workspace, launch_with_pdl)
    backends[Strategy.SYMM_MEM_TWO_SHOT] = SymmMemTwoShotBackend(group, deterministic)
    backends[Strategy.SYMM_MEM_FUSED] = SymmMemFusedBackend(group)
    backends[Strategy.LAMPORT_ONE_SHOT] = LamportOneShotBackend(group)
    if deterministic:
        backends = {s: b for s, b in backends.items() if allowed(s, group.world_size)}
    return backends


__all__ = ["Backend", "ON_DEMAND", "build_backends"]
