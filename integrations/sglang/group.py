"""SGLang's tensor-parallel group as arfusion's `fusion.group.TensorParallelGroup`.

SGLang's ``GroupCoordinator`` (``sglang.srt.distributed.parallel_state``) already holds the two
process groups arfusion needs: ``device_group`` (NCCL on GPU, gloo on CPU) and ``cpu_group``
(gloo). `SGLangTPGroup` uses those very objects (no new process group is made) and routes the
activation all-reduce through the coordinator's own ``all_reduce``, so that the unfused path runs
SGLang's choice of all-reduce (custom all-reduce, pynccl, symmetric memory), which is what it
captures in its CUDA graphs.
"""
from __future__ import annotations

from typing import Any

import torch

from arfusion.fusion.group import TensorParallelGroup


class SGLangTPGroup(TensorParallelGroup):
    """The ranks of one SGLang ``GroupCoordinator``, with its process groups.

    Making it is a collective over the coordinator's CPU group (the ranks exchange their node
    and device identities): every rank of the group makes it together.
    """

    def __init__(self, coordinator: Any, node_rank: int = 0) -> None:
        self.coordinator = coordinator
        world_size = coordinator.world_size
        device = torch.device(coordinator.device)
        node_ids = device_ids = None
        if world_size > 1:
            me = (self.node_identity(node_rank), self.device_identity(device))
            identities: list[Any] = [None] * world_size
            torch.distributed.all_gather_object(identities, me, group=coordinator.cpu_group)
            node_ids, device_ids = [i[0] for i in identities], [i[1] for i in identities]
        super().__init__(coordinator.rank_in_group, world_size, device,
                         coordinator.device_group if world_size > 1 else None,
                         coordinator.cpu_group if world_size > 1 else None, node_ids, device_ids)

    @property
    def ranks(self) -> list[int]:
        """The global ranks of the group, in group order (the coordinator's ``ranks``)."""
        return list(self.coordinator.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group by SGLang's own all-reduce, in place; returns ``x``
        (SGLang's custom all-reduce answers with a new tensor: it is copied back)."""
        if self.world_size == 1:
            return x
        out = self.coordinator.all_reduce(x)
        if out is not x:
            x.copy_(out)
        return x
