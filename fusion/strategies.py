"""The ways one reduction point (all-reduce + residual add + RMSNorm) can run, and the function
that runs each of them.

    s            = sum over TP ranks of x
    residual_out = s + residual        (s when residual is None)
    normed       = residual_out / RMS(residual_out) * weight

    Strategy              how
    nccl                  group all-reduce (NCCL on GPU), then add + RMSNorm (the unfused reference)
    flashinfer_one_shot   flashinfer's trtllm Lamport kernel, one-shot: every rank reads all peers
    flashinfer_two_shot   the same kernel, two-shot (reduce-scatter + all-gather; tokens > ranks)
    symm_mem_two_shot     torch symmetric-memory two-shot all-reduce, then add + RMSNorm
    symm_mem_fused        our Triton two-shot over symmetric memory with add + RMSNorm fused
    torch                 the same math in one function on any device (CPU tests, no flashinfer)

Only ``nccl`` keeps NCCL's summation order (deterministic mode) and runs everywhere. Every
runner consumes ``x`` and ``residual`` (it may overwrite both) and performs the all-reduce
exactly once; none checks its inputs: `fusion.allreduce_fusion.AllReduceFusion` and
`all_reduce_add_rms_norm` check them once, at their entry.

An optional ``quant`` asks for quantized normed output: FP8 (static per-tensor e4m3) fuses into
the flashinfer kernel and is a separate cast elsewhere; FP4 exists only as flashinfer's fused
pattern and needs sm100+ (on sm90 the kernel writes zeros, so it is refused there).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Optional

import torch

from fusion import norm, reference
from fusion.errors import FusionInputError, FusionUnsupportedError
from fusion.group import TensorParallelGroup
from fusion.platform import device_capability, hidden_alignment_error
from fusion.strategy import FusedOutput, Quant, Strategy
from fusion.validation import check_fusion_inputs


FLASHINFER_STRATEGIES = frozenset({Strategy.FLASHINFER_ONE_SHOT, Strategy.FLASHINFER_TWO_SHOT})
SYMM_MEM_STRATEGIES = frozenset({Strategy.SYMM_MEM_TWO_SHOT, Strategy.SYMM_MEM_FUSED})


@dataclass(frozen=True)
class Resources:
    """What the runners reduce over: the group and, where created, the flashinfer workspace
    handle and the symmetric-memory strategies' buffers."""

    group: TensorParallelGroup
    workspace: Any = None  # flashinfer's trtllm workspace (AllReduceFusionWorkspace.handle)
    symm_mem: Any = None  # fusion.backends.symm_mem.SymmMemAllReduce
    symm_fused: Any = None  # fusion.backends.symm_mem_fused.SymmMemFusedAllReduceNorm
    launch_with_pdl: bool = True


Runner = Callable[[Resources, torch.Tensor, Optional[torch.Tensor], torch.Tensor, float, Optional[Quant]], FusedOutput]


def _quantized(normed: torch.Tensor, residual: torch.Tensor, quant: Optional[Quant]) -> FusedOutput:
    """The output of a strategy whose kernels do not quantize: FP8 as a separate cast."""
    if quant is None:
        return FusedOutput(normed, residual)
    if quant.kind == "fp8":
        return FusedOutput(reference.quantize_fp8_static(normed, quant.scale), residual)
    raise FusionUnsupportedError("FP4 output exists only as flashinfer's fused pattern (flashinfer_one_shot / "
                                 "flashinfer_two_shot on an sm100+ GPU)")


def run_nccl(res: Resources, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
             quant: Optional[Quant]) -> FusedOutput:
    """All-reduce ``x`` in place over the group, then add + RMSNorm (flashinfer's in-place
    kernels on GPU, torch elsewhere)."""
    res.group.all_reduce(x)
    return _quantized(*norm.add_rms_norm(x, residual, weight, eps), quant)


def run_torch(res: Resources, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
              quant: Optional[Quant]) -> FusedOutput:
    """The fused semantics in one function on any device: reduce, then fp32 add + RMSNorm
    (out of place: ``residual`` is not written)."""
    res.group.all_reduce(x)
    return _quantized(*reference.add_rms_norm(x, residual, weight, eps), quant)


def run_symm_mem_two_shot(res: Resources, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                          eps: float, quant: Optional[Quant]) -> FusedOutput:
    """torch's symmetric-memory two-shot all-reduce in place, then add + RMSNorm."""
    res.symm_mem.all_reduce(x)
    return _quantized(*norm.add_rms_norm(x, residual, weight, eps), quant)


def run_symm_mem_fused(res: Resources, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       eps: float, quant: Optional[Quant]) -> FusedOutput:
    """Our two Triton launches (`fusion.backends.symm_mem_fused`); ``x`` receives the normed output."""
    return _quantized(*res.symm_fused(x, residual, weight, eps), quant)


# flashinfer.comm.AllReduceFusionPattern values (kept here so that importing this module does not
# need flashinfer).
PATTERN_ALL_REDUCE = 0
PATTERN_RESIDUAL_RMS_NORM = 1
PATTERN_RESIDUAL_RMS_NORM_FP8 = 2
PATTERN_RESIDUAL_RMS_NORM_FP4 = 3


def _flashinfer(res: Resources, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                quant: Optional[Quant], one_shot: bool) -> FusedOutput:
    """One trtllm fused kernel through flashinfer's unified API. Without a residual (the first
    layer): the fused Lamport all-reduce, then flashinfer's rmsnorm. Outputs are new tensors.

    Always ``trigger_completion_at_end=True``: the next kernel may not wait on the grid
    dependency (an early completion signal produced NaNs in vLLM, #45448). ``launch_with_pdl``
    only lets this kernel launch early; it waits on its producers (cudaGridDependencySynchronize)
    before it reads any input, so it is safe after any kernel.
    """
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
    fi_comm.allreduce_fusion(input=x, workspace=res.workspace, pattern=pattern, launch_with_pdl=res.launch_with_pdl,
                             trigger_completion_at_end=True, use_oneshot=one_shot, **kwargs)
    res.group.counters.total += 1
    if residual is None:
        return FusedOutput(norm.rms_norm(residual_out, weight, eps), residual_out)
    return FusedOutput(normed, residual_out, block_scales)


def run_flashinfer_one_shot(res: Resources, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                            eps: float, quant: Optional[Quant]) -> FusedOutput:
    return _flashinfer(res, x, residual, weight, eps, quant, one_shot=True)


def run_flashinfer_two_shot(res: Resources, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                            eps: float, quant: Optional[Quant]) -> FusedOutput:
    return _flashinfer(res, x, residual, weight, eps, quant, one_shot=False)


RUNNERS: dict[Strategy, Runner] = {
    Strategy.NCCL: run_nccl,
    Strategy.FLASHINFER_ONE_SHOT: run_flashinfer_one_shot,
    Strategy.FLASHINFER_TWO_SHOT: run_flashinfer_two_shot,
    Strategy.SYMM_MEM_TWO_SHOT: run_symm_mem_two_shot,
    Strategy.SYMM_MEM_FUSED: run_symm_mem_fused,
    Strategy.TORCH: run_torch,
}


def require_fp4_support(device: torch.device) -> None:
    """FP4 fused patterns need sm100+; on sm90 the kernel runs but writes zeros."""
    cap = device_capability(device)
    if cap is None or cap[0] < 10:
        raise FusionUnsupportedError(
            f"the FP4 fused all-reduce patterns need an sm100+ GPU (Blackwell); this device is "
            f"{'sm%d%d' % cap if cap else device}, where the kernel would write all-zero output"
        )


def check_workspace(x: torch.Tensor, workspace: Any, world_size: int) -> None:
    """`FusionInputError` unless flashinfer's kernel can take ``x`` with ``workspace``: 16-byte
    rows, the workspace's token budget, its Lamport dtype and its world size."""
    tokens, hidden = x.shape
    reason = hidden_alignment_error(hidden, x.dtype)
    if reason:
        raise FusionInputError(reason)
    if workspace is None:
        raise FusionInputError("no fusion workspace: create it (AllReduceFusionWorkspace.ensure) before the call")
    meta = workspace.metadata
    if tokens * hidden > meta["max_token_num"] * meta["hidden_dim"]:
        raise FusionInputError(
            f"{tokens} tokens x hidden {hidden} exceed the workspace "
            f"({meta['max_token_num']} tokens x hidden {meta['hidden_dim']}); grow it or use the unfused path"
        )
    if meta["use_fp32_lamport"] != (x.dtype == torch.float32):
        raise FusionInputError(f"input dtype {x.dtype} does not match the workspace's dtype")
    if meta["tp_size"] != world_size:
        raise FusionInputError(f"workspace was made for {meta['tp_size']} ranks, group has {world_size}")


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    *,
    group: TensorParallelGroup,
    strategy: Strategy = Strategy.NCCL,
    workspace: Any = None,
    quant: Optional[Quant] = None,
    launch_with_pdl: bool = True,
) -> FusedOutput:
    """All-reduce + residual add + RMSNorm over ``group`` by an explicit ``strategy`` (module
    docstring); ``x`` and ``residual`` are consumed. ``workspace``: flashinfer's handle
    (`AllReduceFusionWorkspace.handle`), for the flashinfer strategies only; the symmetric-memory
    strategies own buffers and run through `AllReduceFusion.run`. Raises `FusionInputError`
    naming the problem for inputs the strategy cannot take, before any collective; it never
    silently changes the strategy (the cached per-layer choice is `AllReduceFusion`'s)."""
    strategy = Strategy(strategy)
    check_fusion_inputs(x, residual, weight)
    if strategy in SYMM_MEM_STRATEGIES:
        raise FusionInputError(f"{strategy} owns symmetric buffers: run it through AllReduceFusion.run")
    if strategy in FLASHINFER_STRATEGIES:
        check_workspace(x, workspace, group.world_size)
        if strategy is Strategy.FLASHINFER_TWO_SHOT and x.shape[0] <= group.world_size:
            raise FusionInputError(f"two-shot needs more tokens ({x.shape[0]}) than ranks ({group.world_size})")
    return RUNNERS[strategy](Resources(group, workspace, launch_with_pdl=launch_with_pdl), x, residual, weight, eps,
                             quant)
