"""The fused op: all-reduce(x) + residual add + RMSNorm, and its backends.

    s            = sum over TP ranks of x
    residual_out = s + residual        (s when residual is None)
    normed       = residual_out / RMS(residual_out) * weight

Backends, all with these semantics:

* ``"flashinfer"``: one trtllm Lamport kernel over the CUDA-IPC workspace (GPU, sm90+).
* ``"torch"``: the same math in one function on any device (the all-reduce then fp32
  add + RMSNorm); CPU tests exercise the whole deferral logic with it.
* ``"unfused"``: the reference composition an engine runs without fusion:
  ``tensor_model_parallel_all_reduce(x)`` then flashinfer's ``fused_add_rmsnorm`` on GPU
  (torch elsewhere).

``x`` and ``residual`` are consumed: backends may overwrite them (the unfused path reduces
``x`` in place and normalises in place). Use the returned tensors.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import torch

from fusion import reference
from fusion.errors import FusionInputError
from fusion.group import TensorParallelGroup
from fusion.oneshot import choose_oneshot
from fusion.platform import flashinfer_import_error
from fusion.validation import check_fusion_inputs

Backend = Literal["flashinfer", "torch", "unfused"]
BACKENDS: tuple[str, ...] = ("flashinfer", "torch", "unfused")


def _flashinfer_pattern(
    x: torch.Tensor,
    group: TensorParallelGroup,
    workspace: Any,
    pattern: int,
    use_oneshot: Optional[bool],
    oneshot_max_input_bytes: Optional[int],
    launch_with_pdl: bool,
    **inputs: Any,
) -> dict[str, torch.Tensor]:
    """Pick one-shot/two-shot, run one trtllm pattern, count the reduction it performed."""
    from fusion import flashinfer_ops as fo

    tokens, hidden = x.shape
    if use_oneshot is None:
        use_oneshot = choose_oneshot(tokens, hidden, x.dtype, group.world_size, oneshot_max_input_bytes)
    if not use_oneshot and tokens <= group.world_size:
        raise FusionInputError(f"two-shot needs more tokens ({tokens}) than ranks ({group.world_size})")
    out = fo.fused_allreduce(x, workspace, group.world_size, use_oneshot, pattern, launch_with_pdl=launch_with_pdl, **inputs)
    group.counters.total += 1
    group.counters.fused += 1
    group.counters.flashinfer += 1
    return out


def _gpu_norm_kernels_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float32 and flashinfer_import_error() is None


def unfused_allreduce_residual_rmsnorm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, group: TensorParallelGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path: all-reduce ``x`` in place, then residual add + RMSNorm
    (flashinfer's in-place kernels on GPU, torch elsewhere)."""
    group.all_reduce(x)
    return add_rms_norm_after_reduce(x, residual, weight, eps)


def add_rms_norm_after_reduce(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` for an already reduced ``x``: flashinfer's
    in-place kernels on GPU (``x`` and ``residual`` are overwritten), torch elsewhere."""
    if _gpu_norm_kernels_available(x):
        from fusion.flashinfer_ops import add_rms_norm_inplace

        if residual is None:
            residual = x.clone()
            add_rms_norm_inplace(x, None, weight, eps)
        else:
            add_rms_norm_inplace(x, residual, weight, eps)
        return x, residual
    return reference.add_rms_norm(x, residual, weight, eps)


def torch_fused_allreduce_residual_rmsnorm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, group: TensorParallelGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused semantics in one function on any device: reduce, then fp32 add + RMSNorm."""
    group.all_reduce(x)
    group.counters.fused += 1 if group.world_size > 1 else 0
    return reference.add_rms_norm(x, residual, weight, eps)


def flashinfer_allreduce_residual_rmsnorm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    group: TensorParallelGroup,
    workspace: Any,
    use_oneshot: Optional[bool] = None,
    oneshot_max_input_bytes: Optional[int] = None,
    launch_with_pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flashinfer's trtllm kernel. With a residual: one kernel (kARResidualRMSNorm).
    Without (first layer): the fused Lamport all-reduce, then flashinfer's rmsnorm."""
    from fusion import flashinfer_ops as fo

    common = (x, group, workspace)
    tuning = (use_oneshot, oneshot_max_input_bytes, launch_with_pdl)
    if residual is None:
        summed = _flashinfer_pattern(*common, fo.PATTERN_ALLREDUCE, *tuning)["allreduce"]
        import flashinfer.norm as fi_norm

        normed = torch.empty_like(summed)
        fi_norm.rmsnorm(summed, weight, eps, out=normed)
        return normed, summed
    out = _flashinfer_pattern(*common, fo.PATTERN_RESIDUAL_RMSNORM, *tuning, residual=residual, weight=weight, eps=eps)
    return out["norm_out"], out["residual_out"]


def allreduce_residual_rmsnorm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    *,
    group: TensorParallelGroup,
    backend: Backend = "flashinfer",
    workspace: Any = None,
    use_oneshot: Optional[bool] = None,
    oneshot_max_input_bytes: Optional[int] = None,
    launch_with_pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of all-reduce + residual add + RMSNorm over ``group``.

    ``workspace``: the flashinfer workspace handle (``AllReduceFusionWorkspace.handle``),
    needed by the ``"flashinfer"`` backend only. ``use_oneshot`` forces one-shot/two-shot;
    None picks by message size (`fusion.oneshot.choose_oneshot`). ``launch_with_pdl``: launch
    the flashinfer kernel with programmatic dependent launch (see `fused_allreduce`). Raises `FusionInputError`
    for inputs the chosen backend cannot take; it never silently changes the backend.
    """
    check_fusion_inputs(x, residual, weight)
    if backend == "flashinfer":
        return flashinfer_allreduce_residual_rmsnorm(
            x, residual, weight, eps, group, workspace, use_oneshot, oneshot_max_input_bytes, launch_with_pdl
        )
    if backend == "torch":
        return torch_fused_allreduce_residual_rmsnorm(x, residual, weight, eps, group)
    if backend == "unfused":
        return unfused_allreduce_residual_rmsnorm(x, residual, weight, eps, group)
    raise ValueError(f"unknown fusion backend {backend!r}; expected one of {BACKENDS}")


def allreduce_residual_rmsnorm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    *,
    group: TensorParallelGroup,
    backend: Backend = "flashinfer",
    workspace: Any = None,
    use_oneshot: Optional[bool] = None,
    launch_with_pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8(normed / scale), residual_out)``: the op above with static per-tensor FP8
    (e4m3) output (kARResidualRMSNormFP8Quant). ``scale`` is a one-element fp32 tensor on
    the input's device (a tensor, so CUDA graphs may update it between replays)."""
    check_fusion_inputs(x, residual, weight)
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise FusionInputError(f"scale must be a one-element float32 tensor, got {scale.dtype} x {scale.numel()}")
    if backend == "flashinfer":
        from fusion import flashinfer_ops as fo

        out = _flashinfer_pattern(x, group, workspace, fo.PATTERN_RESIDUAL_RMSNORM_FP8, use_oneshot, None,
                                  launch_with_pdl, residual=residual, weight=weight, eps=eps, scale=scale)
        return out["quant_out"], out["residual_out"]
    normed, residual_out = allreduce_residual_rmsnorm(x, residual, weight, eps, group=group, backend=backend)
    return reference.quantize_fp8_static(normed, scale), residual_out


def allreduce_residual_rmsnorm_fp4(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    *,
    group: TensorParallelGroup,
    workspace: Any,
    use_oneshot: Optional[bool] = None,
    launch_with_pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fp4 packed [tokens, hidden/2], swizzled 128x4 scale factors, residual_out)``
    (kARResidualRMSNormFP4Quant). Needs sm100+: raises `FusionUnsupportedError` below."""
    from fusion import flashinfer_ops as fo

    check_fusion_inputs(x, residual, weight)
    fo.require_fp4_support(x.device)
    if x.dtype == torch.float32:
        raise FusionInputError("the FP4 pattern takes fp16 or bf16 input, not float32")
    out = _flashinfer_pattern(x, group, workspace, fo.PATTERN_RESIDUAL_RMSNORM_FP4, use_oneshot, None,
                              launch_with_pdl, residual=residual, weight=weight, eps=eps, scale=scale)
    return out["quant_out"], out["scale_out"], out["residual_out"]
