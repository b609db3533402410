"""Tensor-parallel process groups: one TP group per process, reached through `get_tp_group()`.

`init_tensor_parallel` creates the device group (NCCL on GPU, gloo on CPU) and a gloo CPU
group for votes and broadcasts, and records which node and which CUDA device each rank runs on.
Ranks that share a GPU (a TP size larger than the GPUs of a node: testing TP code paths on one
GPU) are detected from the device identities the ranks exchange, never assumed from a flag: their
device group is gloo on CUDA tensors (NCCL refuses two ranks on one device), and torch symmetric
memory is allowed to map overlapping devices. The fused all-reduce
is not the group's: the engine builds one `fusion.AllReduceFusion` per model over this group
and passes it to the model's layers.
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from arfusion.fusion import TensorParallelGroup, disable_capturable_collectives

logger = logging.getLogger(__name__)
_TP_GROUP: Optional[TensorParallelGroup] = None
# torch symmetric memory refuses to map two ranks' buffers on one device unless this is set
SYMM_MEM_OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def default_device(local_rank: int) -> torch.device:
    """The device of the ``local_rank``-th rank on its node: ``cuda:<local_rank % visible GPUs>``
    when CUDA is available (more ranks than GPUs share them), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
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
    `default_device(rank)`. ``timeout_s`` bounds every collective of the group, so a lost peer
    surfaces as an error instead of a hang; the rendezvous, where every rank joins, waits
    ``max(timeout_s, RENDEZVOUS_TIMEOUT_S)``. The ranks first exchange their node and device
    identities over gloo; the device group is NCCL only when every rank has a CUDA device of its
    own."""
    global _TP_GROUP
    if _TP_GROUP is not None:
        raise RuntimeError("the tensor-parallel group is already initialised")
    device = torch.device(device) if device is not None else default_device(rank)
    if device.type == "cuda":
        try:
            torch.cuda.set_device(device)
        except RuntimeError as exc:  # torch's CUDA errors are RuntimeErrors: say what it means here
            raise RuntimeError(f"rank {rank} cannot use {device}: {str(exc).splitlines()[0]} (a GPU in an "
                               "exclusive compute mode or held by another process refuses a second rank; ranks "
                               "sharing a GPU need compute mode Default, ideally with the MPS daemon)") from None
    if world_size == 1:
        _TP_GROUP = TensorParallelGroup(0, 1, device)
        return _TP_GROUP
    timeout = datetime.timedelta(seconds=timeout_s)
    rendezvous = datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))
    dist.init_process_group("gloo", init_method=init_method, world_size=world_size, rank=rank, timeout=rendezvous)
    ranks = list(range(world_size))
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
    identities: list[object] = [None] * world_size
    me = (TensorParallelGroup.node_identity(node_rank), TensorParallelGroup.device_identity(device))
    dist.all_gather_object(identities, me, group=cpu_group)
    node_ids, device_ids = [i[0] for i in identities], [i[1] for i in identities]
    probe = TensorParallelGroup(rank, world_size, device, cpu_group, cpu_group, node_ids, device_ids)
    if probe.shares_gpu:
        # before the first symmetric allocation; only in this case (it is a correctness mode)
        os.environ[SYMM_MEM_OVERLAP_ENV] = "1"
        if rank == 0:
            logger.warning("%s; the device group is gloo on CUDA tensors", probe.shared_gpu_note)
    backend = "nccl" if device.type == "cuda" and not probe.shares_gpu else "gloo"
    device_group = dist.new_group(ranks, backend=backend, timeout=timeout)  # not WORLD: its timeout is the rendezvous'
    _TP_GROUP = TensorParallelGroup(rank, world_size, device, device_group, cpu_group, node_ids, device_ids)
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
    disable_capturable_collectives(_TP_GROUP)  # its symmetric buffer goes before the process groups
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = None
