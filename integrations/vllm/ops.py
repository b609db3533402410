"""The torch custom ops the pass puts in vLLM's compiled graph, each with a fake implementation
(so Inductor and CUDA graphs can trace them) and a real one that runs arfusion's dispatch.

    arfusion::all_reduce_add_rms_norm(x!, residual!, weight, eps, site) -> ()
        s = sum over TP ranks of x
        residual <- s + residual                      (in place, as vLLM's fused_add_rms_norm)
        x        <- residual / RMS(residual) * weight (in place; RMS in fp32)
    arfusion::all_reduce_rms_norm(x!, weight, eps, site) -> normed
        x        <- s                                 (in place: the reduced tensor)
        normed    = s / RMS(s) * weight               (a new tensor)

``site`` is the reduction's position in its compiled graph: it stands for the layer in the
op's cached (layer, batch size) decision. The real implementation hands the call to the
process's `fusion.AllReduceFusion` for the input's shape (`runtime.fusion_for`), which picks the
strategy (cached per (site, tokens)) and runs it; a backend that returns fresh tensors is copied
back into the mutated inputs. The ops mutate their inputs, so they appear in the graph wrapped in
``auto_functionalized`` and Inductor decides whether the inputs can be reused in place.
"""
from __future__ import annotations

import torch

from arfusion.fusion import PartialSum
from arfusion.integrations.vllm import runtime

OP_NAMESPACE = "arfusion"


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst <- src`` unless ``src`` already is ``dst``'s memory."""
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)


@torch.library.custom_op(f"{OP_NAMESPACE}::all_reduce_add_rms_norm", mutates_args=("x", "residual"))
def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            site: int) -> None:
    op = runtime.fusion_for(x)
    runtime.calls[site] += 1
    normed, total = op.reduce_add_rms_norm(PartialSum(pending=x, layer_id=site, op=op), residual, weight, eps)
    if normed.data_ptr() == residual.data_ptr() or total.data_ptr() == x.data_ptr():
        normed, total = normed.clone(), total.clone()  # outputs in each other's buffer: copy both out first
    _write(x, normed)
    _write(residual, total)


@all_reduce_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, site: int) -> None:
    return None


@torch.library.custom_op(f"{OP_NAMESPACE}::all_reduce_rms_norm", mutates_args=("x",))
def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, site: int) -> torch.Tensor:
    op = runtime.fusion_for(x)
    runtime.calls[site] += 1
    normed, total = op.reduce_add_rms_norm(PartialSum(pending=x, layer_id=site, op=op), None, weight, eps)
    if normed.data_ptr() == x.data_ptr():
        normed = normed.clone()
    _write(x, total)
    return normed


@all_reduce_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, site: int) -> torch.Tensor:
    return torch.empty_like(x)


ADD_RMS_NORM = torch.ops.arfusion.all_reduce_add_rms_norm.default
RMS_NORM = torch.ops.arfusion.all_reduce_rms_norm.default
