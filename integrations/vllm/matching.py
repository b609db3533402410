"""Finding "all-reduce, then (residual add +) RMSNorm" in a post-grad FX graph of vLLM.

A site is one all-reduce whose only consumer is an RMSNorm of its result:

    all-reduce   any form of `collectives.all_reduce_input`: vllm.all_reduce (GPU), vLLM's CPU
                 shared-memory op, torch.distributed's functional all-reduce + wait_tensor
    norm         vllm_ir.fused_add_rms_norm(s, residual, w, eps) -> (normed, residual_out)
                 vllm_ir.rms_norm(s, w, eps) -> normed
                 auto_functionalized(_C.fused_add_rms_norm, input=s, residual=r, weight=w, epsilon=eps)
                 auto_functionalized(_C.rms_norm, result=o, input=s, weight=w, epsilon=eps)
                 the decomposed chain of RMSNorm.forward_static (vLLM's native norm, Inductor's
                 decompositions): t = f32(s) [+ f32(residual)]; residual_out = bf16(t);
                 normed = dtype(t * rsqrt(mean(t ** 2, -1, keepdim) + eps)) * w

A site's partial sum and residual are contiguous [tokens, hidden] tensors of one dtype. A site
records the partial sum ``x``, the residual (None without one), the weight, eps, the node
whose value is ``normed``, the node whose value is ``residual_out`` (None when nothing reads it,
e.g. before the final norm) and the nodes that die once those two are replaced. Anything else
(another reader of an intermediate value, a weight of another dtype or shape, a variance over a
slice, a norm without weight) is not a site: the graph keeps vLLM's own ops there.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from arfusion.integrations.vllm.collectives import all_reduce_input, all_reduce_nodes, auto_functionalized_of
from arfusion.integrations.vllm.collectives import is_call as _is
from arfusion.integrations.vllm.collectives import op_name as _name

_CONVERT = torch.ops.prims.convert_element_type.default
_ADD = torch.ops.aten.add.Tensor
_MUL = torch.ops.aten.mul.Tensor
_POW = torch.ops.aten.pow.Tensor_Scalar
_MEAN = torch.ops.aten.mean.dim
_RSQRT = torch.ops.aten.rsqrt.default


@dataclass
class Site:
    """One all-reduce + (residual add +) RMSNorm, ready to be replaced (module docstring)."""

    all_reduce: fx.Node  # the node whose value is the reduced sum
    x: fx.Node  # the partial sum each rank reduces
    residual: Optional[fx.Node]
    weight: fx.Node
    eps: float
    normed: fx.Node
    residual_out: Optional[fx.Node]
    # the nodes between them, readers first: they die once normed and residual_out are replaced
    dead: list[fx.Node] = field(default_factory=list)


def _val(node: Any) -> Optional[torch.Tensor]:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _getitem(node: fx.Node, index: int) -> Optional[fx.Node]:
    """The unique ``getitem(node, index)`` reader of ``node``, None when there is none."""
    found = [u for u in node.users if _is(u, operator.getitem) and u.args[1] == index]
    return found[0] if len(found) == 1 else None


def _only_readers(node: fx.Node, allowed: set[fx.Node]) -> bool:
    return set(node.users) <= allowed


def _weight_ok(weight: Any, s: fx.Node) -> bool:
    """``weight`` is a [hidden] tensor of the reduced value's dtype."""
    w, v = _val(weight), _val(s)
    return w is not None and v is not None and w.dtype == v.dtype and tuple(w.shape) == (v.shape[-1],)


def match_site(ar: fx.Node) -> Optional[Site]:
    """The `Site` of all-reduce node ``ar`` (`all_reduce_input` is not None for it), or None."""
    x = all_reduce_input(ar)
    if x is None or not _rows(x) or _val(ar) is None:
        return None
    site = _match_ir(ar, x) or _match_c_ops(ar, x) or _match_chain(ar, x)
    if site is None or (site.residual is not None and not _rows(site.residual, like=x)):
        return None
    return site


def _rows(node: Any, like: Optional[fx.Node] = None) -> bool:
    """``node`` is a contiguous [tokens, hidden] tensor (of ``like``'s shape and dtype): what the
    fusion op takes (the strides are the traced ones: Inductor keeps a custom op's input layout)."""
    v = _val(node)
    if v is None or v.dim() != 2:
        return False
    tokens, hidden = v.shape
    if not (statically_known_true(v.stride(1) == 1) and statically_known_true(v.stride(0) == hidden)):
        return False  # no guard is added: an unknown stride (symbolic) counts as not contiguous
    if like is None:
        return True
    w = _val(like)
    return v.dtype == w.dtype and statically_known_true(tokens == w.shape[0]) and statically_known_true(
        hidden == w.shape[1])


def _match_ir(ar: fx.Node, x: fx.Node) -> Optional[Site]:
    """vLLM IR norms (0.20+): ``vllm_ir.rms_norm`` / ``vllm_ir.fused_add_rms_norm``."""
    for norm in ar.users:
        name = _name(norm.target) if norm.op == "call_function" else ""
        if name == "vllm_ir::fused_add_rms_norm" and norm.args[0] is ar and len(ar.users) == 1:
            residual, weight, eps = norm.args[1], norm.args[2], norm.args[3]
            if (len(norm.args) > 4 and norm.args[4] is not None) or not _weight_ok(weight, ar):
                return None
            normed, res_out = _getitem(norm, 0), _getitem(norm, 1)
            if normed is None or not _only_readers(norm, {n for n in (normed, res_out) if n is not None}):
                return None
            return Site(ar, x, residual, weight, float(eps), normed, res_out, [norm] + all_reduce_nodes(ar))
        if name == "vllm_ir::rms_norm" and norm.args[0] is ar:
            weight, eps = norm.args[1], norm.args[2]
            if (len(norm.args) > 3 and norm.args[3] is not None) or not _weight_ok(weight, ar):
                return None
            others = [u for u in ar.users if u is not norm]
            return Site(ar, x, None, weight, float(eps), norm, ar if others else None, all_reduce_nodes(ar))
    return None


def _match_c_ops(ar: fx.Node, x: fx.Node) -> Optional[Site]:
    """vLLM's own CUDA norm kernels, in the graph when the custom op ``rms_norm`` is enabled."""
    for norm in ar.users:
        if auto_functionalized_of(norm, "_C::fused_add_rms_norm") and norm.kwargs.get("input") is ar \
                and len(ar.users) == 1:
            kw = norm.kwargs
            if not _weight_ok(kw["weight"], ar):
                return None
            normed, res_out = _getitem(norm, 1), _getitem(norm, 2)
            if normed is None or not _only_readers(norm, {n for n in (normed, res_out) if n is not None}):
                return None
            return Site(ar, x, kw["residual"], kw["weight"], float(kw["epsilon"]), normed, res_out,
                        [norm] + all_reduce_nodes(ar))
        if auto_functionalized_of(norm, "_C::rms_norm") and norm.kwargs.get("input") is ar:
            kw = norm.kwargs
            normed = _getitem(norm, 1)
            if normed is None or not _weight_ok(kw["weight"], ar) or not _only_readers(norm, {normed}):
                return None
            others = [u for u in ar.users if u is not norm]
            return Site(ar, x, None, kw["weight"], float(kw["epsilon"]), normed, ar if others else None,
                        [norm] + all_reduce_nodes(ar))
    return None


def _match_chain(ar: fx.Node, x: fx.Node) -> Optional[Site]:
    """The decomposed native RMSNorm (module docstring), with or without the residual add. The
    reduced value may have other fp32 readers (without a residual it is the next residual)."""
    for cast in ar.users:
        if _is(cast, _CONVERT) and cast.args[1] == torch.float32:
            site = _match_chain_from(ar, x, cast)
            if site is not None:
                return site
    return None


def _match_chain_from(ar: fx.Node, x: fx.Node, cast: fx.Node) -> Optional[Site]:
    dtype = _val(ar).dtype
    residual = cast_residual = None
    t = cast
    adds = [u for u in cast.users if _is(u, _ADD) and len(u.args) == 2 and isinstance(u.args[0], fx.Node)
            and isinstance(u.args[1], fx.Node)]
    if len(cast.users) == 1 and len(adds) == 1:  # with a residual: t = f32(s) + f32(residual)
        t = adds[0]
        other = t.args[1] if t.args[0] is cast else t.args[0]
        if not (_is(other, _CONVERT) and other.args[1] == torch.float32 and len(other.users) == 1):
            return None
        cast_residual, residual = other, other.args[0]
        if _val(residual) is None or _val(residual).dtype != dtype or len(ar.users) != 1:
            return None
    chain = _norm_chain(t, dtype)
    if chain is None:
        return None
    normed, weight, eps, inner, res_out = chain
    if not _weight_ok(weight, ar) or (residual is None and res_out is not None):
        return None
    if residual is None:
        res_out = ar if len(ar.users) > 1 else None
    dead = inner + ([t, cast_residual] if residual is not None else []) + [cast] + all_reduce_nodes(ar)
    return Site(ar, x, residual, weight, eps, normed, res_out, dead)


def _norm_chain(t: fx.Node, dtype: torch.dtype) -> Optional[tuple[fx.Node, fx.Node, float, list[fx.Node],
                                                                  Optional[fx.Node]]]:
    """From the fp32 sum ``t``: (normed, weight, eps, the chain's inner nodes, bf16(t) or None)."""
    pows = [u for u in t.users if _is(u, _POW) and u.args[1] == 2]
    res_outs = [u for u in t.users if _is(u, _CONVERT) and u.args[1] == dtype]
    if len(pows) != 1 or len(res_outs) > 1:
        return None
    power = pows[0]
    mean = next(iter(power.users)) if len(power.users) == 1 else None
    if not (_is(mean, _MEAN) and list(mean.args[1]) in ([-1], [_val(t).dim() - 1]) and mean.args[2] is True
            and len(mean.users) == 1):
        return None
    add_eps = next(iter(mean.users))
    if not (_is(add_eps, _ADD) and add_eps.args[0] is mean and isinstance(add_eps.args[1], float)
            and len(add_eps.users) == 1):
        return None
    rsqrt = next(iter(add_eps.users))
    if not (_is(rsqrt, _RSQRT) and len(rsqrt.users) == 1):
        return None
    scaled = next(iter(rsqrt.users))
    if not (_is(scaled, _MUL) and set(scaled.args) == {t, rsqrt} and len(scaled.users) == 1):
        return None
    down = next(iter(scaled.users))
    if not (_is(down, _CONVERT) and down.args[1] == dtype and len(down.users) == 1):
        return None
    normed = next(iter(down.users))
    if not (_is(normed, _MUL) and down in normed.args and len(normed.args) == 2):
        return None
    weight = normed.args[1] if normed.args[0] is down else normed.args[0]
    res_out = res_outs[0] if res_outs else None
    if not _only_readers(t, {power, scaled} | ({res_out} if res_out is not None else set())):
        return None
    return normed, weight, float(add_eps.args[1]), [down, scaled, rsqrt, add_eps, mean, power], res_out
