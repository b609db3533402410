"""The tensor-parallel group that the fused op reduces over.

A `TensorParallelGroup` bundles the two process groups a TP rank needs:

* ``device_group``: reduces activations (NCCL on GPU, gloo on CPU);
* ``cpu_group``: a gloo group for small control traffic (votes, broadcasts of Python
  objects) that must work even while the device group is busy or broken.

It also knows which CUDA device each rank runs on (the identities the ranks exchange when the
group is made). Two ranks on one GPU are supported for correctness (`shared_gpu_note`): the
device group is then gloo (NCCL refuses two ranks per GPU), and every timing taken there is
not representative of two GPUs. There `fusion.capturable` can give the group a stand-in for the
device group's all-reduce and all-gather over torch symmetric memory, which CUDA graphs capture.
"""
from __future__ import annotations

import socket
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

# one all-gather into a flat tensor (concatenated along dim 0): newer torch (2.13) names it
# all_gather_single and deprecates all_gather_into_tensor; use whichever this torch has
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CapturableCollectives(Protocol):
    """What the group asks of its capturable stand-in (`fusion.capturable.SymmMemCollectives`)."""

    def fits(self, x: torch.Tensor) -> bool: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


class TensorParallelGroup:
    """Ranks ``0..world_size-1`` of one tensor-parallel group.

    With ``world_size == 1`` no process group is needed and every collective is the identity.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        device_group: Optional[dist.ProcessGroup] = None,
        cpu_group: Optional[dist.ProcessGroup] = None,
        node_ids: Optional[list[Any]] = None,
        device_ids: Optional[list[Any]] = None,
    ) -> None:
        if world_size > 1 and (device_group is None or cpu_group is None):
            raise ValueError("a TP group of world_size > 1 needs a device group and a CPU group")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a TP group of world_size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.node_ids = list(node_ids) if node_ids is not None else [0] * world_size
        # per rank: (node identity, device identity); the device identity is None off CUDA
        self.device_ids = list(device_ids) if device_ids is not None else [None] * world_size
        # a graph-capturable stand-in for the device group's all-reduce and all-gather, for ranks
        # sharing a GPU (whose device group is gloo): `fusion.capturable`; None: the device group
        self.capturable: Optional[CapturableCollectives] = None

    @property
    def spans_nodes(self) -> bool:
        """True when the ranks live on more than one node (CUDA IPC cannot reach them all)."""
        return len(set(self.node_ids)) > 1

    @property
    def shared_gpus(self) -> dict[str, list[int]]:
        """``{GPU name: [ranks]}`` of every CUDA device that more than one rank of the group
        runs on (ranks on other nodes never share one); empty when each rank has its own."""
        ranks: dict[Any, list[int]] = {}
        for rank, (node, dev) in enumerate(zip(self.node_ids, self.device_ids)):
            if dev is not None:
                ranks.setdefault((node, dev[0]), []).append(rank)
        return {self.device_ids[rs[0]][1]: rs for rs in ranks.values() if len(rs) > 1}

    @property
    def shares_gpu(self) -> bool:
        """True when two or more ranks of the group run on one CUDA device."""
        return bool(self.shared_gpus)

    @property
    def ranks_on_this_gpu(self) -> int:
        """How many ranks of the group run on this rank's device (1 off CUDA)."""
        me = (self.node_ids[self.rank], self.device_ids[self.rank])
        if me[1] is None:
            return 1
        return sum((node, dev) == me for node, dev in zip(self.node_ids, self.device_ids))

    @property
    def shared_gpu_note(self) -> Optional[str]:
        """One line for logs and server info when ranks share a GPU, else None."""
        shared = self.shared_gpus
        if not shared:
            return None
        where = "; ".join(f"ranks {', '.join(map(str, rs))} share {gpu}" for gpu, rs in shared.items())
        return (f"TP ranks share a GPU ({where}): the TP code paths run correctly, but every timing is "
                "time-shared and not representative of one GPU per rank")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``. Through the capturable stand-in
        (`capturable`) when it is set and holds ``x``, else the device group."""
        if self.world_size == 1:
            return x
        if self.capturable is not None and self.capturable.fits(x):
            return self.capturable.all_reduce(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along dim 0 in rank order into ``out``
        (``[world_size * x.shape[0], *x.shape[1:]]``, contiguous); returns ``out``. Through the
        capturable stand-in when it is set and holds ``x``, else the device group."""
        if self.world_size == 1:
            return out.copy_(x)
        if self.capturable is not None and self.capturable.fits(x):
            return self.capturable.all_gather_into(out, x)
        _all_gather_flat(out, x.contiguous(), group=self.device_group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: ``x`` takes rank ``src``'s values on every rank, over the device group
        (stream-ordered on a GPU: no host sync). Returns ``x``."""
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=dist.get_global_rank(self.device_group, src), group=self.device_group)
        return x

    def all_agree(self, ok: bool) -> bool:
        """Vote over the CPU group: True only if ``ok`` is True on every rank."""
        if self.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(flag.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, over the CPU group."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as held by rank ``src`` (a group rank), on every rank, over the CPU group."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.cpu_group, src), group=self.cpu_group)
        return box[0]

    @staticmethod
    def device_identity(device: torch.device) -> Optional[tuple[str, str]]:
        """What identifies this rank's CUDA device across processes: ``(UUID, "cuda:N (name)")``
        (the UUID, unlike the index, does not depend on CUDA_VISIBLE_DEVICES); None off CUDA."""
        if device.type != "cuda":
            return None
        props = torch.cuda.get_device_properties(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (str(props.uuid), f"cuda:{index} ({props.name})")

    @staticmethod
    def node_identity(node_rank: int) -> tuple[str, int]:
        """What identifies this process's node: host name and the launcher's node rank."""
        return (socket.gethostname(), node_rank)
