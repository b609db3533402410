"""The pass on the graphs vLLM's GPU build compiles, traced here on CPU with vLLM's real ops
(``vllm.all_reduce`` and the vLLM IR norms, or the native norm's decomposed chain), so that the
GPU forms are exercised where no GPU is: every all-reduce + norm becomes one arfusion op, wired
to the same inputs and readers. Needs vLLM (``bash integrations/vllm/ci.sh``); skipped without it.
"""
from __future__ import annotations

import operator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; bash integrations/vllm/ci.sh runs these tests")

import torch  # noqa: E402
import vllm.distributed.parallel_state  # noqa: E402,F401  (registers torch.ops.vllm.all_reduce)
import vllm.ir.ops  # noqa: E402,F401  (registers torch.ops.vllm_ir.*)
from torch._inductor.decomposition import select_decomp_table  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from integrations.vllm import ops, runtime  # noqa: E402
from integrations.vllm.fusion_pass import ARFUSION_PASS  # noqa: E402

EPS = 1e-6
GROUP = "tp:0"
AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized


def _native_add_rms_norm(s, residual, weight):
    """vLLM's native fused_add_rms_norm (RMSNorm.forward_static), as the model code writes it."""
    t = s.to(torch.float32) + residual.to(torch.float32)
    new_residual = t.to(s.dtype)
    t = t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return t.to(s.dtype) * weight, new_residual


def ir_fused_add(x, residual, w):
    s = torch.ops.vllm.all_reduce(x, GROUP)
    normed, res = torch.ops.vllm_ir.fused_add_rms_norm(s, residual, w, EPS)
    return normed * 2, res + 1


def ir_first_layer(x, w):
    s = torch.ops.vllm.all_reduce(x, GROUP)
    return torch.ops.vllm_ir.rms_norm(s, w, EPS) * 2, s + 1  # the reduced sum is the next residual


def native_fused_add(x, residual, w):
    normed, res = _native_add_rms_norm(torch.ops.vllm.all_reduce(x, GROUP), residual, w)
    return normed * 2, res + 1


def two_layers(x1, x2, residual, w1, w2):
    normed, res = torch.ops.vllm_ir.fused_add_rms_norm(torch.ops.vllm.all_reduce(x1, GROUP), residual, w1, EPS)
    h = normed * 3
    normed2, res2 = _native_add_rms_norm(torch.ops.vllm.all_reduce(x2 + h, GROUP), res, w2)
    return normed2, res2


def norm_of_a_slice(x, w):
    s = torch.ops.vllm.all_reduce(x, GROUP)
    return torch.ops.vllm_ir.rms_norm(s, w, EPS, 8)


def other_reader(x, residual, w):
    s = torch.ops.vllm.all_reduce(x, GROUP)
    normed, res = torch.ops.vllm_ir.fused_add_rms_norm(s, residual, w, EPS)
    return normed, res, s  # the reduced value is read besides the norm: not a site


def _trace(fn, *shapes):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, generator=g).to(torch.bfloat16) for shape in shapes]
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def _targets(gm):
    return [n.args[0] if n.target is AUTO_FUNCTIONALIZED else n.target for n in gm.graph.nodes
            if n.op == "call_function"]


def _run_pass(gm) -> dict[str, int]:
    ARFUSION_PASS(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return runtime.graphs[-1]


@pytest.mark.parametrize("fn, op", [(ir_fused_add, ops.ADD_RMS_NORM), (native_fused_add, ops.ADD_RMS_NORM),
                                    (ir_first_layer, ops.RMS_NORM)])
def test_one_site_becomes_one_arfusion_op(fn, op):
    shapes = [(5, 64), (5, 64), (64,)] if op is ops.ADD_RMS_NORM else [(5, 64), (64,)]
    gm = _trace(fn, *shapes)
    assert _run_pass(gm) == {"replaced": 1, "kept": 0}
    targets = _targets(gm)
    assert targets.count(op) == 1 and torch.ops.vllm.all_reduce.default not in targets
    assert not any(getattr(t, "namespace", "") == "vllm_ir" for t in targets)
    assert torch.ops.aten.rsqrt.default not in targets
    fused = next(n for n in gm.graph.nodes if n.target is AUTO_FUNCTIONALIZED and n.args[0] is op)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert fused.kwargs["x"] is placeholders[0] and fused.kwargs["weight"] is placeholders[-1]
    assert fused.kwargs["eps"] == pytest.approx(EPS) and fused.kwargs["site"] == 0
    if op is ops.ADD_RMS_NORM:
        assert fused.kwargs["residual"] is placeholders[1]
    # both outputs (the normed value and the new residual) are read from the fused op
    items = {u.args[1] for u in fused.users if u.target is operator.getitem}
    assert items == ({1, 2} if op is ops.ADD_RMS_NORM else {0, 1})


def test_consecutive_sites_are_numbered_and_chained():
    gm = _trace(two_layers, (5, 64), (5, 64), (5, 64), (64,), (64,))
    assert _run_pass(gm) == {"replaced": 2, "kept": 0}
    fused = [n for n in gm.graph.nodes if n.target is AUTO_FUNCTIONALIZED]
    assert [n.kwargs["site"] for n in fused] == [0, 1]
    first_residual_out = next(u for u in fused[0].users if u.args[1] == 2)
    assert fused[1].kwargs["residual"] is first_residual_out  # the second norm adds the first one's sum


@pytest.mark.parametrize("fn, shapes", [(norm_of_a_slice, [(5, 64), (64,)]),
                                        (other_reader, [(5, 64), (5, 64), (64,)]),
                                        (ir_fused_add, [(1, 5, 64), (1, 5, 64), (64,)])],  # not [tokens, hidden]
                         ids=["variance-of-a-slice", "other-reader", "3-d"])
def test_what_is_not_a_site_keeps_vllms_ops(fn, shapes):
    gm = _trace(fn, *shapes)
    before = _targets(gm)
    assert _run_pass(gm) == {"replaced": 0, "kept": 1}
    assert _targets(gm) == before
