"""The IPC workspace of flashinfer's trtllm fused all-reduce, for one TP group.

The workspace holds, on every rank, Lamport buffers that all other ranks of the group map
through CUDA IPC: about ``4 * world * max_tokens * hidden * 2`` bytes. Creating it is a
collective (handles are exchanged), so it is created, grown and destroyed by all ranks
together, outside CUDA-graph capture. A failure on any rank is voted over the CPU group so
that every rank falls back together instead of one rank waiting for another.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.platform import flashinfer_import_error, is_capturing_cuda_graph
from arfusion.fusion.voting import voted_failure

logger = logging.getLogger(__name__)

# factory(group, max_tokens, hidden, dtype) -> an object with destroy(); raises on failure.
WorkspaceFactory = Callable[[TensorParallelGroup, int, int, torch.dtype], Any]


def lamport_element_size(dtype: torch.dtype) -> int:
    """Bytes of one element in the trtllm kernels' buffers: 4 for fp32, 2 for fp16 and bf16."""
    return 4 if dtype == torch.float32 else 2


def workspace_bytes(world_size: int, max_tokens: int, hidden: int, dtype: torch.dtype) -> int:
    """Device memory one rank's trtllm workspace takes: a two-shot buffer of
    ``world * tokens * hidden * itemsize`` plus three Lamport buffers of the same size."""
    return 4 * world_size * max_tokens * hidden * lamport_element_size(dtype)


def create_flashinfer_workspace(group: TensorParallelGroup, max_tokens: int, hidden: int, dtype: torch.dtype) -> Any:
    """flashinfer's unified-API workspace on the trtllm backend (never "mnnvl"/"auto": those
    may use NVLink multicast)."""
    import flashinfer.comm as fi_comm

    return fi_comm.create_allreduce_fusion_workspace(
        backend="trtllm",
        world_size=group.world_size,
        rank=group.rank,
        max_token_num=max_tokens,
        hidden_dim=hidden,
        dtype=dtype,
        group=group.device_group,
    )


def _preflight(group: TensorParallelGroup, max_tokens: int, hidden: int, dtype: torch.dtype) -> Optional[str]:
    """Why this rank cannot create the flashinfer workspace, checked before any collective."""
    reason = flashinfer_import_error()
    if reason:
        return reason
    if group.device.type != "cuda":
        return f"the TP group's device is {group.device}, not a CUDA GPU"
    free, _ = torch.cuda.mem_get_info(group.device)
    need = workspace_bytes(group.world_size, max_tokens, hidden, dtype)
    if need > free:
        return f"workspace needs {need / 2**20:.0f} MiB, only {free / 2**20:.0f} MiB free on {group.device}"
    return None


@dataclass(frozen=True)
class WorkspaceShape:
    max_tokens: int
    hidden: int
    dtype: torch.dtype


class AllReduceFusionWorkspace:
    """Explicit, grow-only workspace object for one TP group.

    ``ensure(max_tokens, hidden, dtype)`` is collective: every rank calls it with the same
    arguments; it returns True on every rank or False on every rank.
    """

    def __init__(self, group: TensorParallelGroup, factory: Optional[WorkspaceFactory] = None) -> None:
        self.group = group
        self._factory = factory or create_flashinfer_workspace
        self._preflight = _preflight if factory is None else (lambda *a: None)
        self.handle: Any = None
        self.shape: Optional[WorkspaceShape] = None
        self.failure: Optional[str] = None
        self._finalizer: Optional[weakref.finalize] = None  # destroys the handle at exit too

    @property
    def ready(self) -> bool:
        return self.handle is not None

    def fits(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """True when a call of ``num_tokens`` x ``hidden`` of ``dtype`` fits the workspace
        (local check, no collective)."""
        s = self.shape
        return (
            self.handle is not None
            and s is not None
            and dtype == s.dtype
            and num_tokens * hidden <= s.max_tokens * s.hidden
        )

    def ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Make the workspace hold ``max_tokens`` x ``hidden`` of ``dtype``; grows, never shrinks.

        Collective over the group. Refused (RuntimeError) inside CUDA-graph capture. On a
        failure on any rank every rank destroys what it made, logs the reasons once and
        returns False.
        """
        if max_tokens <= 0 or hidden <= 0:
            raise ValueError(f"workspace size must be positive, got max_tokens={max_tokens}, hidden={hidden}")
        if self.fits(max_tokens, hidden, dtype) and self.shape is not None and self.shape.hidden == hidden:
            return True
        if is_capturing_cuda_graph():
            raise RuntimeError("the fusion workspace cannot be created or grown during CUDA-graph capture")
        if self.shape is not None and self.shape.dtype == dtype and self.shape.hidden == hidden:
            max_tokens = max(max_tokens, self.shape.max_tokens)  # grow only
        ok = self._vote("preflight", lambda: self._preflight(self.group, max_tokens, hidden, dtype))
        if ok:
            self.destroy()
            new_handle: list[Any] = []
            ok = self._vote("creation", lambda: new_handle.append(self._factory(self.group, max_tokens, hidden, dtype)))
            if new_handle:
                self.handle = new_handle[0]
                self._finalizer = weakref.finalize(self, _destroy_handle, self.handle)
            if not ok:
                self.destroy()
        if ok:
            self.shape = WorkspaceShape(max_tokens, hidden, dtype)
            self.failure = None
        return ok

    def _vote(self, phase: str, step: Callable[[], Optional[str]]) -> bool:
        """`fusion.voting.voted_failure` of ``step``; rank 0 logs every rank's reason once."""
        failure = voted_failure(self.group, step)
        if failure is None:
            return True
        self.failure = failure
        if self.group.rank == 0:
            logger.warning("fusion workspace %s failed, all ranks fall back to the unfused path: %s", phase, failure)
        return False

    def destroy(self) -> None:
        """Free the workspace on this rank. Safe to call more than once."""
        if self.handle is not None:
            if self.group.device.type == "cuda":
                torch.cuda.synchronize(self.group.device)
            self.handle = None
            if self._finalizer is not None:
                self._finalizer()  # runs _destroy_handle once, then never again
        self.shape = None


def _destroy_handle(handle: Any) -> None:
    if hasattr(handle, "destroy"):
        handle.destroy()
