"""flashinfer's trtllm fused all-reduce + residual + RMSNorm (Lamport IPC kernels), one-shot and
two-shot: two backends over one shared `AllReduceFusionWorkspace`.

    flashinfer_one_shot   every rank reads every peer's whole input (latency-bound)
    flashinfer_two_shot   reduce-scatter + all-gather (bandwidth-bound); needs more tokens than ranks

Both need: flashinfer importable, a CUDA GPU of a generation the kernels are built for (sm90 /
sm100), every rank on one node (CUDA IPC), rows of whole 16-byte accesses, and the workspace
holding the batch. Quantized output: FP8 fuses into the kernel; FP4 needs sm100+ (on sm90 the
kernel runs but writes zeros, so it is refused).

Always ``trigger_completion_at_end=True``: the next kernel may not wait on the grid dependency
(an early completion signal produced NaNs in vLLM, #45448). ``launch_with_pdl`` only lets this
kernel launch early; it waits on its producers (cudaGridDependencySynchronize) before it reads
any input, so it is safe after any kernel.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from arfusion.fusion import norm
from arfusion.fusion.backends.base import (
    NO_ROWS,
    Backend,
    BuildContext,
    Costs,
    Made,
    Rows,
)
from arfusion.fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace
from arfusion.fusion.errors import FusionInputError, FusionUnsupportedError
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.options import FLASHINFER
from arfusion.fusion.platform import (
    device_capability,
    flashinfer_import_error,
    hidden_alignment_error,
)
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy

# GPU generations the trtllm Lamport kernels are built and validated for.
FUSED_KERNEL_SM_MAJORS = (9, 10)
# flashinfer.comm.AllReduceFusionPattern values (kept here so that importing this module does not
# need flashinfer).
PATTERN_ALL_REDUCE = 0
PATTERN_RESIDUAL_RMS_NORM = 1
PATTERN_RESIDUAL_RMS_NORM_FP8 = 2
PATTERN_RESIDUAL_RMS_NORM_FP4 = 3


def flashinfer_unavailable_reason(group: TensorParallelGroup, hidden: int, dtype: torch.dtype) -> str | None:
    """Why flashinfer's fused kernel can never run for this group, hidden size and dtype (None if it can)."""
    if group.spans_nodes:
        return "the TP group spans nodes; the trtllm IPC workspace is single-node"
    reason = flashinfer_import_error()
    if reason:
        return reason
    sm = device_capability(group.device)
    if sm is None:
        return f"the TP group's device is {group.device}: the flashinfer fused kernel needs an sm90/sm100 GPU"
    if sm[0] not in FUSED_KERNEL_SM_MAJORS:
        return f"GPU is sm{sm[0]}{sm[1]}; the flashinfer fused kernel needs sm90 or sm100"
    return hidden_alignment_error(hidden, dtype)


def require_fp4_support(device: torch.device) -> None:
    """FP4 fused patterns need sm100+; on sm90 the kernel runs but writes zeros."""
    cap = device_capability(device)
    if cap is None or cap[0] < 10:
        raise FusionUnsupportedError(
            f"the FP4 fused all-reduce patterns need an sm100+ GPU (Blackwell); this device is "
            f"{f'sm{cap[0]}{cap[1]}' if cap else device}, where the kernel would write all-zero output"
        )


class FlashInferBackend(Backend):
    """One of flashinfer's two fused kernels over the op's shared workspace."""

    options = (FLASHINFER,)
    det_max_world = 0
    det_note = ("flashinfer's kernel reduces and normalises in its own order; its normed output changes with the "
                "number of rows in the call")

    def __init__(self, group: TensorParallelGroup, workspace: AllReduceFusionWorkspace,
                 launch_with_pdl: bool = True) -> None:
        super().__init__(group)
        self.workspace = workspace
        self.launch_with_pdl = launch_with_pdl

    @classmethod
    def for_op(cls, context: BuildContext) -> FlashInferBackend:
        """Over the op's one workspace, shared by both kernels."""
        return cls(context.group, context.shared(AllReduceFusionWorkspace), context.launch_with_pdl)

    @classmethod
    def standalone(cls, group: TensorParallelGroup, x: torch.Tensor, workspace: AllReduceFusionWorkspace | None,
                   launch_with_pdl: bool) -> FlashInferBackend:
        """Over ``workspace``, ensured by the caller for ``group``'s world size."""
        if workspace is None or not workspace.ready:
            raise FusionInputError("no fusion workspace: create it (AllReduceFusionWorkspace.ensure) before the call")
        if workspace.group.world_size != group.world_size:
            raise FusionInputError(f"the workspace was made for {workspace.group.world_size} ranks, the group has "
                                   f"{group.world_size}")
        misaligned = hidden_alignment_error(x.shape[1], x.dtype)
        if misaligned:
            raise FusionInputError(misaligned)
        return cls(group, workspace, launch_with_pdl)

    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Collective: the shared workspace for ``max_tokens`` rows (grown, never shrunk)."""
        if not self.vote(lambda: flashinfer_unavailable_reason(self.group, hidden, dtype)):
            return False
        ok = self.workspace.ensure(max_tokens, hidden, dtype)
        self.failure = None if ok else self.workspace.failure
        return ok

    def rows(self) -> Rows:
        shape = self.workspace.shape
        return Rows(1, shape.max_tokens) if shape is not None and self.workspace.ready else NO_ROWS

    @property
    def capacity(self) -> int:
        shape = self.workspace.shape
        return 0 if shape is None else shape.max_tokens

    def _destroy(self) -> None:
        self.workspace.destroy()

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant: Quant | None = None) -> FusedOutput:
        """One fused kernel; the outputs are new tensors (``x`` and ``residual`` are only read)."""
        if not (self.fits(x.shape[0]) and self.workspace.fits(x.shape[0], x.shape[1], x.dtype)):
            raise FusionInputError(f"{self.strategy} cannot take {tuple(x.shape)} {x.dtype}: the workspace holds "
                                   f"{self.workspace.shape}; grow it (ensure) or use another strategy")
        return run_trtllm_fusion(self.workspace.handle, x, residual, weight, eps, quant, self.one_shot,
                                 self.launch_with_pdl)


class FlashInferOneShotBackend(FlashInferBackend):
    """flashinfer's trtllm Lamport kernel, one-shot: every rank reads all peers"""

    strategy = Strategy.FLASHINFER_ONE_SHOT
    made = Made.PRIMARY
    cost: ClassVar[Costs] = {2: (4.328, 4.268, 0.003254)}
    fallback_rank = 0
    one_shot = True


class FlashInferTwoShotBackend(FlashInferBackend):
    """the same kernel, two-shot (reduce-scatter + all-gather; tokens > ranks)"""

    strategy = Strategy.FLASHINFER_TWO_SHOT
    cost: ClassVar[Costs] = {2: (9.333, 4.487, 0.004395)}
    fallback_rank = 1

    def rows(self) -> Rows:
        """Two-shot splits the tokens over the ranks: it needs more tokens than ranks."""
        most = super().rows().most
        return Rows(self.group.world_size + 1, most) if most else NO_ROWS


def run_trtllm_fusion(workspace: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, quant: Quant | None, one_shot: bool, launch_with_pdl: bool) -> FusedOutput:
    """One trtllm fused kernel through flashinfer's unified API (``workspace``: its handle).
    Without a residual (the first layer): the fused Lamport all-reduce, then flashinfer's
    rmsnorm. Outputs are new tensors."""
    import flashinfer.comm as fi_comm

    tokens, hidden = x.shape
    residual_out = torch.empty_like(x)
    kwargs: dict[str, Any] = {}
    block_scales = None
    if residual is None:
        if quant is not None:
            raise FusionInputError("quantized output needs a residual (the first layer has none)")
        pattern, kwargs["output"] = PATTERN_ALL_REDUCE, residual_out
    else:
        kwargs.update(residual_in=residual, rms_gamma=weight, rms_eps=eps, residual_out=residual_out)
        if quant is None:
            pattern, normed = PATTERN_RESIDUAL_RMS_NORM, torch.empty_like(x)
            # this pattern never writes the plain all-reduce output: pass a real buffer of the
            # right shape so that flashinfer does not allocate one per call
            kwargs.update(norm_out=normed, output=normed)
        elif quant.kind == "fp8":
            pattern = PATTERN_RESIDUAL_RMS_NORM_FP8
            normed = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
            kwargs.update(quant_out=normed, scale_factor=quant.scale, output=residual_out)
        else:
            require_fp4_support(x.device)
            pattern = PATTERN_RESIDUAL_RMS_NORM_FP4
            normed = torch.empty((tokens, hidden // 2), dtype=torch.uint8, device=x.device)
            sf_size = fi_comm.compute_fp4_swizzled_layout_sf_size(tokens, hidden // 16)
            block_scales = torch.empty((sf_size,), dtype=torch.uint8, device=x.device)
            kwargs.update(quant_out=normed, scale_out=block_scales, scale_factor=quant.scale, output=residual_out,
                          layout_code=fi_comm.QuantizationSFLayout.SWIZZLED_128x4)
    fi_comm.allreduce_fusion(input=x, workspace=workspace, pattern=pattern, launch_with_pdl=launch_with_pdl,
                             trigger_completion_at_end=True, use_oneshot=one_shot, **kwargs)
    if residual is None:
        return FusedOutput(norm.rms_norm(residual_out, weight, eps), residual_out)
    return FusedOutput(normed, residual_out, block_scales)
