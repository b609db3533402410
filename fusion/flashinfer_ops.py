"""Calls into flashinfer: the trtllm fused all-reduce patterns and the plain norm kernels.

Only imported lazily, where flashinfer is known to import (GPU machines).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from fusion.errors import FusionInputError, FusionUnsupportedError
from fusion.platform import device_capability, hidden_alignment_error

# flashinfer.comm.AllReduceFusionPattern values (kept here so that importing this module
# does not need flashinfer).
PATTERN_ALLREDUCE = 0
PATTERN_RESIDUAL_RMSNORM = 1
PATTERN_RESIDUAL_RMSNORM_FP8 = 2
PATTERN_RESIDUAL_RMSNORM_FP4 = 3


def _check_kernel_shape(x: torch.Tensor, workspace: Any, world_size: int) -> None:
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


def fused_allreduce(
    x: torch.Tensor,
    workspace: Any,
    world_size: int,
    use_oneshot: bool,
    pattern: int,
    residual: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    scale: Optional[torch.Tensor] = None,
    launch_with_pdl: bool = True,
) -> dict[str, torch.Tensor]:
    """Run one trtllm fused pattern through flashinfer's unified API; returns the outputs it
    wrote (``allreduce``, ``residual_out``, ``norm_out``, ``quant_out``, ``scale_out``).

    Always ``trigger_completion_at_end=True``: the next kernel may not wait on the grid
    dependency (an early completion signal produced NaNs in vLLM, #45448). ``launch_with_pdl``
    only lets this kernel launch early; it waits on its producers (cudaGridDependencySynchronize)
    before it reads any input, so it is safe after any kernel.
    """
    import flashinfer.comm as fi_comm

    _check_kernel_shape(x, workspace, world_size)
    tokens, hidden = x.shape
    outputs: dict[str, torch.Tensor] = {}
    kwargs: dict[str, Any] = {}
    if pattern == PATTERN_ALLREDUCE:
        outputs["allreduce"] = torch.empty_like(x)
        kwargs["output"] = outputs["allreduce"]
    else:
        outputs["residual_out"] = torch.empty_like(x)
        kwargs.update(residual_in=residual, rms_gamma=weight, rms_eps=eps, residual_out=outputs["residual_out"])
        if pattern == PATTERN_RESIDUAL_RMSNORM:
            outputs["norm_out"] = torch.empty_like(x)
            kwargs["norm_out"] = outputs["norm_out"]
            # This pattern never writes the plain all-reduce output; pass a real buffer
            # of the right shape so flashinfer does not allocate one per call.
            kwargs["output"] = outputs["norm_out"]
        elif pattern == PATTERN_RESIDUAL_RMSNORM_FP8:
            outputs["quant_out"] = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
            kwargs.update(quant_out=outputs["quant_out"], scale_factor=scale, output=outputs["residual_out"])
        elif pattern == PATTERN_RESIDUAL_RMSNORM_FP4:
            outputs["quant_out"] = torch.empty((tokens, hidden // 2), dtype=torch.uint8, device=x.device)
            sf_size = fi_comm.compute_fp4_swizzled_layout_sf_size(tokens, hidden // 16)
            outputs["scale_out"] = torch.empty((sf_size,), dtype=torch.uint8, device=x.device)
            kwargs.update(
                quant_out=outputs["quant_out"],
                scale_out=outputs["scale_out"],
                scale_factor=scale,
                layout_code=fi_comm.QuantizationSFLayout.SWIZZLED_128x4,
                output=outputs["residual_out"],
            )
        else:
            raise ValueError(f"unknown fusion pattern {pattern}")
    fi_comm.allreduce_fusion(
        input=x,
        workspace=workspace,
        pattern=pattern,
        launch_with_pdl=launch_with_pdl,
        trigger_completion_at_end=True,
        use_oneshot=use_oneshot,
        **kwargs,
    )
    return outputs


def require_fp4_support(device: torch.device) -> None:
    """FP4 fused patterns need sm100+; on sm90 the kernel runs but writes zeros."""
    cap = device_capability(device)
    if cap is None or cap[0] < 10:
        raise FusionUnsupportedError(
            f"the FP4 fused all-reduce patterns need an sm100+ GPU (Blackwell); this device is "
            f"{'sm%d%d' % cap if cap else device}, where the kernel would write all-zero output"
        )


def add_rms_norm_inplace(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> None:
    """flashinfer's norm kernels, in place: with a residual, ``residual += x`` then
    ``x = rms_norm(residual) * weight``; without, ``x = rms_norm(x) * weight``."""
    import flashinfer.norm as fi_norm

    if residual is None:
        fi_norm.rmsnorm(x, weight, eps, out=x)
    else:
        fi_norm.fused_add_rmsnorm(x, residual, weight, eps)
