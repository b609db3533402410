"""The pass on the graphs vLLM compiles, traced here on CPU with vLLM's real ops (the vLLM IR
norms, or the native norm's decomposed chain) and each form an all-reduce takes in them
(integrations/vllm/collectives.py): ``vllm.all_reduce`` (GPU), vLLM's CPU shared-memory op, and
torch.distributed's functional all-reduce + wait_tensor. Each form is written into the traced
function, not left to this machine's vLLM build (the shared-memory op, missing from the AVX2 build,
is declared with its schema where vLLM's library lacks it), so every form is exercised on any
CPU: every all-reduce + norm becomes one arfusion op, wired to the same inputs and readers, and
whatever is left is counted and named. Needs vLLM (``bash integrations/vllm/ci.sh``); skipped
without it.
"""
from __future__ import annotations

import operator
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; bash integrations/vllm/ci.sh runs these tests")

import torch  # noqa: E402
import vllm._custom_ops  # noqa: E402,F401  (loads vLLM's kernel library: its _C ops, shm_allreduce where built)
import vllm.distributed.parallel_state  # noqa: E402,F401  (registers torch.ops.vllm.all_reduce)
import vllm.ir.ops  # noqa: E402,F401  (registers torch.ops.vllm_ir.*)
from torch._inductor.decomposition import select_decomp_table  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from arfusion.integrations.vllm import ops, runtime  # noqa: E402
from arfusion.integrations.vllm.fusion_pass import ARFUSION_PASS  # noqa: E402

EPS = 1e-6
GROUP = "tp:0"
AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized
SHM_SCHEMA = "shm_allreduce(int handle, Tensor(a!) data) -> ()"  # vLLM's csrc/cpu/torch_bindings.cpp

# vLLM's AVX2 build has no shared-memory all-reduce. Its kernel library is loaded above: declaring
# the op before a build that has it loads would register it twice, which aborts the process.
if not hasattr(torch.ops._C, "shm_allreduce"):
    _SHM_LIB = torch.library.Library("_C", "FRAGMENT")
    _SHM_LIB.define(SHM_SCHEMA)
    _SHM_LIB.impl("shm_allreduce", lambda handle, data: None, "Meta")


def _vllm_all_reduce(x):
    return torch.ops.vllm.all_reduce(x, GROUP)


def _shm_all_reduce(x):
    """vLLM's CPU communicator, functionalized: the reduced tensor is the op's new ``data``."""
    return AUTO_FUNCTIONALIZED(torch.ops._C.shm_allreduce.default, handle=0, data=x)[1]


def _c10d_all_reduce(x):
    """torch.distributed.all_reduce as Dynamo and AOTAutograd leave it."""
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", GROUP))


FORMS = {"vllm::all_reduce": _vllm_all_reduce, "_C::shm_allreduce": _shm_all_reduce,
         "_c10d_functional::all_reduce": _c10d_all_reduce}
all_reduce = _vllm_all_reduce  # the form the traced functions use (the `form` fixture sets it)


@pytest.fixture(params=list(FORMS))
def form(request, monkeypatch) -> str:
    monkeypatch.setattr(sys.modules[__name__], "all_reduce", FORMS[request.param])
    return request.param


def _native_add_rms_norm(s, residual, weight):
    """vLLM's native fused_add_rms_norm (RMSNorm.forward_static), as the model code writes it."""
    t = s.to(torch.float32) + residual.to(torch.float32)
    new_residual = t.to(s.dtype)
    t = t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return t.to(s.dtype) * weight, new_residual


def ir_fused_add(x, residual, w):
    s = all_reduce(x)
    normed, res = torch.ops.vllm_ir.fused_add_rms_norm(s, residual, w, EPS)
    return normed * 2, res + 1


def ir_first_layer(x, w):
    s = all_reduce(x)
    return torch.ops.vllm_ir.rms_norm(s, w, EPS) * 2, s + 1  # the reduced sum is the next residual


def native_fused_add(x, residual, w):
    normed, res = _native_add_rms_norm(all_reduce(x), residual, w)
    return normed * 2, res + 1


def two_layers(x1, x2, residual, w1, w2):
    normed, res = torch.ops.vllm_ir.fused_add_rms_norm(all_reduce(x1), residual, w1, EPS)
    h = normed * 3
    normed2, res2 = _native_add_rms_norm(all_reduce(x2 + h), res, w2)
    return normed2, res2


def norm_of_a_slice(x, w):
    s = all_reduce(x)
    return torch.ops.vllm_ir.rms_norm(s, w, EPS, 8)


def other_reader(x, residual, w):
    s = all_reduce(x)
    normed, res = torch.ops.vllm_ir.fused_add_rms_norm(s, residual, w, EPS)
    return normed, res, s  # the reduced value is read besides the norm: not a site


def _trace(fn, *shapes):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(shape, generator=g).to(torch.bfloat16) for shape in shapes]
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    gm.graph.eliminate_dead_code()  # as Inductor's post-grad passes do before the custom pass
    return gm


def _targets(gm):
    return [n.args[0] if n.target is AUTO_FUNCTIONALIZED else n.target for n in gm.graph.nodes
            if n.op == "call_function"]


def _run_pass(gm) -> dict[str, int]:
    ARFUSION_PASS(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return {k: v for k, v in runtime.graphs[-1].items() if k != "forms"}


@pytest.mark.parametrize("fn, op", [(ir_fused_add, ops.ADD_RMS_NORM), (native_fused_add, ops.ADD_RMS_NORM),
                                    (ir_first_layer, ops.RMS_NORM)])
def test_one_site_becomes_one_arfusion_op(fn, op, form):
    shapes = [(5, 64), (5, 64), (64,)] if op is ops.ADD_RMS_NORM else [(5, 64), (64,)]
    gm = _trace(fn, *shapes)
    assert _run_pass(gm) == {"replaced": 1, "kept": 0, "kept_forms": {}}
    targets = _targets(gm)
    assert targets.count(op) == 1 and not {torch.ops.vllm.all_reduce.default, torch.ops._C.shm_allreduce.default,
                                           torch.ops._c10d_functional.all_reduce.default,
                                           torch.ops._c10d_functional.wait_tensor.default} & set(targets)
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


def test_consecutive_sites_are_numbered_and_chained(form):
    gm = _trace(two_layers, (5, 64), (5, 64), (5, 64), (64,), (64,))
    assert _run_pass(gm) == {"replaced": 2, "kept": 0, "kept_forms": {}}
    assert runtime.graphs[-1]["forms"] == {form: 2}
    fused = [n for n in gm.graph.nodes if n.target is AUTO_FUNCTIONALIZED]
    assert [n.kwargs["site"] for n in fused] == [0, 1]
    first_residual_out = next(u for u in fused[0].users if u.args[1] == 2)
    assert fused[1].kwargs["residual"] is first_residual_out  # the second norm adds the first one's sum


@pytest.mark.parametrize("fn, shapes", [(norm_of_a_slice, [(5, 64), (64,)]),
                                        (other_reader, [(5, 64), (5, 64), (64,)]),
                                        (ir_fused_add, [(1, 5, 64), (1, 5, 64), (64,)])],  # not [tokens, hidden]
                         ids=["variance-of-a-slice", "other-reader", "3-d"])
def test_what_is_not_a_site_keeps_vllms_ops(fn, shapes, form, caplog):
    gm = _trace(fn, *shapes)
    before = _targets(gm)
    assert _run_pass(gm) == {"replaced": 0, "kept": 1, "kept_forms": {form: 1}}
    assert _targets(gm) == before
    assert f"the pass replaced nothing in this graph: its 1 x {form} is no all-reduce + RMSNorm site" in caplog.text


def _all_gather_then_norm(x, residual, w):
    s = all_reduce(x)
    normed, res = torch.ops.vllm_ir.fused_add_rms_norm(s, residual, w, EPS)
    gathered = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(normed, 2, GROUP))
    return gathered, res


def test_a_collective_of_any_other_form_is_counted_and_named(form, caplog):
    """The site is replaced; the all-gather after it, which no site can be, is what the pass left."""
    gm = _trace(_all_gather_then_norm, (5, 64), (5, 64), (64,))
    assert _run_pass(gm) == {"replaced": 1, "kept": 1, "kept_forms": {"_c10d_functional::all_gather_into_tensor": 1}}
    assert "1 x _c10d_functional::all_gather_into_tensor stayed in the graph unfused" in caplog.text


def test_a_mean_all_reduce_is_no_site():
    """Only a sum is the partial sums' reduction: an average is counted, never fused."""
    def mean_then_norm(x, w):
        s = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "avg", GROUP))
        return torch.ops.vllm_ir.rms_norm(s, w, EPS)
    gm = _trace(mean_then_norm, (5, 64), (64,))
    assert _run_pass(gm) == {"replaced": 0, "kept": 1, "kept_forms": {"_c10d_functional::all_reduce": 1}}
