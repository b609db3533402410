"""The post-grad pass that puts arfusion's fused all-reduce + residual add + RMSNorm into vLLM's
compiled graph. Enable it with vLLM's own option (vLLM's ``fuse_allreduce_rms`` left off):

    compilation_config={"inductor_passes": {"post_grad_custom_post_pass": PASS_NAME}}

(``PASS_NAME`` = "arfusion.integrations.vllm.fusion_pass.ARFUSION_PASS", in `integrations.vllm`.)
vLLM resolves that dotted name as an attribute of the name's top-level package (0.20-0.27 do
``__import__(module).__dict__[name]``), so importing this module also sets ``ARFUSION_PASS`` on
that package (``arfusion``); a resolver that follows the full path finds it here. Importing this module
checks the vLLM version (`versions.check_vllm_version`, one line outside the range).

On each graph the pass finds every site (`matching.match_site`, in graph order) and replaces it:

    with a residual     auto_functionalized(arfusion::all_reduce_add_rms_norm, x, residual, w, eps, site)
                        -> normed = [1], residual_out = [2]
    without a residual  auto_functionalized(arfusion::all_reduce_rms_norm, x, w, eps, site)
                        -> normed = [0], the reduced sum = [1]

The all-reduce and the norm's nodes then have no readers and are erased. What is left is counted
by looking for any collective (`collectives.collective_form`), whatever its form. Rank 0 logs per
graph the sites replaced and the collectives left, by form, and a second warning naming the forms
when the pass replaced nothing or left any; every process records both in `runtime.graphs`.
Before it touches a graph the pass refuses a config with vLLM's own ``fuse_allreduce_rms`` on
(`config_check.check`; that fusion would have taken the sites already).
"""
from __future__ import annotations

import collections
import hashlib
import inspect
import logging
import operator
import sys
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from arfusion.integrations.vllm import collectives, config_check, matching, ops, runtime
from arfusion.integrations.vllm.collectives import all_reduce_form, all_reduce_input, collective_form
from arfusion.integrations.vllm.matching import Site, match_site
from arfusion.integrations.vllm.versions import check_vllm_version, installed_vllm_version

logger = logging.getLogger(__name__)
_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized


check_vllm_version(installed_vllm_version())

try:  # vLLM's pass base (a CustomGraphPass): vLLM then takes our uuid as is
    from vllm.compilation.passes.inductor_pass import InductorPass as _PassBase
except ImportError:
    _PassBase = CustomGraphPass


class ArfusionAllReduceRMSNormPass(_PassBase):
    """Replaces all-reduce + (residual add +) RMSNorm by arfusion's op (module docstring)."""

    def __call__(self, graph: fx.Graph) -> None:
        _check_current_config()
        replaced = 0
        forms: collections.Counter[str] = collections.Counter()  # the all-reduce forms replaced
        erased: set[fx.Node] = set()
        for node in list(graph.nodes):
            if node in erased or all_reduce_input(node) is None:
                continue  # erased by an earlier rewrite, or not an all-reduce
            site = match_site(node)
            if site is not None:
                forms[all_reduce_form(node)] += 1
                erased |= _rewrite(graph, site, replaced)
                replaced += 1
        kept = collections.Counter(f for f in map(collective_form, graph.nodes) if f is not None)
        runtime.graphs.append({"replaced": replaced, "kept": sum(kept.values()), "kept_forms": dict(kept),
                               "forms": dict(forms)})
        if _rank() != 0:
            return
        logger.warning("arfusion: replaced %d all-reduce + RMSNorm site(s) with arfusion's fused op (%s); %d "
                       "collective(s) left as they were%s", replaced, _forms(forms) or "none",
                       sum(kept.values()), f" ({_forms(kept)})" if kept else "")
        if kept and not replaced:
            logger.warning("arfusion: the pass replaced nothing in this graph: its %s %s no all-reduce + RMSNorm "
                           "site the pass matches (integrations/vllm/matching.py lists the forms it knows)",
                           _forms(kept), "is" if sum(kept.values()) == 1 else "are")
        elif kept:
            logger.warning("arfusion: %s stayed in the graph unfused (not followed by an RMSNorm of their own, or "
                           "in a form the pass does not match)", _forms(kept))

    def uuid(self) -> Any:
        """Inductor's (and vLLM's) cache key of this pass: the source of the modules that decide
        what it writes into the graph."""
        digest = hashlib.sha256()
        for module in (sys.modules[__name__], collectives, matching, ops):
            digest.update(inspect.getsource(module).encode())
        return digest.hexdigest()


def _forms(counts: collections.Counter[str]) -> str:
    return ", ".join(f"{n} x {form}" for form, n in sorted(counts.items()))


def _check_current_config() -> None:
    """`config_check.refuse_own_fusion` on the vLLM config being compiled, when one is current."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # vLLM releases without it, or no vLLM (the pass's own tests)
        return
    config = get_current_vllm_config_or_none()
    if config is not None and config.compilation_config is not None:
        config_check.refuse_own_fusion(config)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _rewrite(graph: fx.Graph, site: Site, index: int) -> set[fx.Node]:
    """Insert the fused op before the first reader of the site's outputs, point the readers at it
    and erase the site's old nodes; returns the erased nodes."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for out in (site.normed, site.residual_out) if out is not None for u in out.users
               if u not in site.dead and u is not site.normed]
    first = min(readers + [site.normed], key=order.__getitem__)
    fake = {n: n.meta["val"] for n in (site.x, site.residual, site.weight) if n is not None}
    with graph.inserting_before(first):
        if site.residual is not None:
            fused = graph.call_function(_AUTO_FUNCTIONALIZED, (ops.ADD_RMS_NORM,), {
                "x": site.x, "residual": site.residual, "weight": site.weight, "eps": site.eps, "site": index})
            fused.meta["val"] = (None, _like(fake[site.x]), _like(fake[site.residual]))
            normed, total = _item(graph, fused, 1), _item(graph, fused, 2)
        else:
            fused = graph.call_function(_AUTO_FUNCTIONALIZED, (ops.RMS_NORM,), {
                "x": site.x, "weight": site.weight, "eps": site.eps, "site": index})
            fused.meta["val"] = (_like(fake[site.x]), _like(fake[site.x]))
            normed, total = _item(graph, fused, 0), _item(graph, fused, 1)
    site.normed.replace_all_uses_with(normed)
    if site.residual_out is not None:  # the old nodes of the site keep reading it until erased
        site.residual_out.replace_all_uses_with(
            total, delete_user_cb=lambda user: user not in site.dead and user is not site.normed)
    pending = list(dict.fromkeys(n for n in [site.normed, site.residual_out] + site.dead if n is not None))
    erased: set[fx.Node] = set()
    while True:  # readers first; the all-reduce may be read by the norm's nodes until they go
        dead = [n for n in pending if n not in erased and not n.users]
        if not dead:
            return erased
        for node in dead:
            graph.erase_node(node)
            erased.add(node)


def _like(t: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``t``'s shape, dtype and device (in ``t``'s fake mode)."""
    mode = t.fake_mode if hasattr(t, "fake_mode") else None
    if mode is None:
        return torch.empty_like(t)
    with mode:
        return torch.empty_like(t)


def _item(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


ARFUSION_PASS = ArfusionAllReduceRMSNormPass()
setattr(sys.modules[__name__.partition(".")[0]], "ARFUSION_PASS", ARFUSION_PASS)
