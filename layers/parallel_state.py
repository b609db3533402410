"""Tensor-parallel process groups: one TP group per process, reached through `get_tp_group()`.

`init_tensor_parallel` creates the device group (NCCL on GPU, gloo on CPU) and a gloo CPU
group for votes and broadcasts, and records which node each rank runs on. The fused all-reduce
is not the group's: the engine builds one `fusion.AllReduceFusion` per model over this group
and passes it to the model's layers.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from fusion import TensorParallelGroup

_TP_GROUP: Optional[TensorParallelGroup] = None
# How long the rendezvous waits for every rank to join (or ``timeout_s``, if longer): starting a
# process and importing torch is start-up, which a loaded machine slows, not a collective.
RENDEZVOUS_TIMEOUT_S = 120.0


def init_tensor_parallel(
    world_size: int,
    rank: int,
    init_method: str = "env://",
    device: Optional[torch.device] = None,
    node_rank: int = 0,
    timeout_s: float = 120.0,
) -> TensorParallelGroup:
    """Join a TP group of ``world_size`` ranks (all ranks of the job). ``device`` defaults to
    ``cuda:<rank % local GPUs>`` when CUDA is available, else the CPU. ``timeout_s`` bounds
    every collective of the group, so a lost peer surfaces as an error instead of a hang; the
    rendezvous, where every rank joins, waits ``max(timeout_s, RENDEZVOUS_TIMEOUT_S)``."""
    global _TP_GROUP
    if _TP_GROUP is not None:
        raise RuntimeError("the tensor-parallel group is already initialised")
    if device is None:
        device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        _TP_GROUP = TensorParallelGroup(0, 1, device)
        return _TP_GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    rendezvous = datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank, timeout=rendezvous)
    ranks = list(range(world_size))
    device_group = dist.new_group(ranks, backend=backend, timeout=timeout)  # not WORLD: its timeout is the rendezvous'
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
    node_ids: list[object] = [None] * world_size
    dist.all_gather_object(node_ids, TensorParallelGroup.node_identity(node_rank), group=cpu_group)
    _TP_GROUP = TensorParallelGroup(rank, world_size, device, device_group, cpu_group, node_ids)
    return _TP_GROUP


def get_tp_group() -> TensorParallelGroup:
    """The TP group of this process; raises if `init_tensor_parallel` has not run."""
    if _TP_GROUP is None:
        raise RuntimeError("the tensor-parallel group is not initialised: call init_tensor_parallel first")
    return _TP_GROUP


def destroy_tensor_parallel() -> None:
    """Destroy the process groups. Destroy every fusion op made over the group first (IPC state
    held past the process group can hang the exit)."""
    global _TP_GROUP
    if _TP_GROUP is None:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = None
