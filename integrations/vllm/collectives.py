"""The forms a tensor-parallel all-reduce takes in a post-grad FX graph of vLLM, and what counts
as a collective at all.

An all-reduce of ``x`` (a sum over the TP ranks) reaches the pass in one of these forms, by
platform and build (read from vLLM 0.20-0.32's ``GroupCoordinator.all_reduce`` and its CPU
communicator):

    vllm.all_reduce        vllm.all_reduce(x, group)          platforms whose
                                                              ``use_custom_op_collectives()`` is True (CUDA)
    cpu shm                getitem(auto_functionalized(_C.shm_allreduce, handle, data=x), 1)
                                                              vLLM's CPU build with its shared-memory
                                                              all-reduce (AVX-512 and Arm builds)
    c10d functional        wait_tensor(_c10d_functional.all_reduce(x, "sum", group))
                                                              torch.distributed.all_reduce traced by
                                                              Dynamo: vLLM's CPU communicator without the
                                                              shared-memory op (the AVX2 x86 build), or a
                                                              group whose ranks disagree on its name
    legacy c10d functional wait_tensor(c10d_functional.all_reduce(x, "sum", tag, ranks, size))

`all_reduce_input` recognises these (the value of the node is the reduced sum); `collective_form`
names every collective node of a graph, of these forms or any other (an in-place
``_c10d_functional.all_reduce_``, an all-gather, vLLM's own fused all-reduce + norm, ...), so
that what a pass leaves behind is counted whatever its form.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch
from torch import fx

_AUTO_FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "symm_mem")
_COLLECTIVE_NAME = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast", re.IGNORECASE)
_WAITS = ("_c10d_functional::wait_tensor", "c10d_functional::wait_tensor")
OWN_NAMESPACE = "arfusion"  # the pass's own ops: fused sites, not collectives left behind


def op_name(target: Any) -> str:
    """``namespace::op`` of an op overload or packet, '' for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return ""


def is_call(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def auto_functionalized_of(node: Any, name: str) -> bool:
    """``node`` is ``auto_functionalized(op, ...)`` of the op named ``name`` (``ns::op``)."""
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _AUTO_FUNCTIONALIZED
            and bool(node.args) and op_name(node.args[0]) == name)


def _called_op(node: fx.Node) -> str:
    """The op a call node runs: its target, or the op wrapped by ``auto_functionalized``."""
    if node.op != "call_function":
        return ""
    if node.target in _AUTO_FUNCTIONALIZED and node.args:
        return op_name(node.args[0])
    return op_name(node.target)


def collective_form(node: fx.Node) -> Optional[str]:
    """The op name of ``node`` when it is a collective (module docstring), else None. A
    ``wait_tensor`` is part of the collective it waits for, not one of its own."""
    name = _called_op(node)
    if not name or name in _WAITS:
        return None
    namespace, _, op = name.partition("::")
    if namespace in (OWN_NAMESPACE, "aten", "prims"):  # aten.broadcast_tensors is no collective
        return None
    if namespace in _COLLECTIVE_NAMESPACES or _COLLECTIVE_NAME.search(op):
        return name
    return None


def _is_sum(reduce_op: Any) -> bool:
    return isinstance(reduce_op, str) and reduce_op.lower() == "sum"


def all_reduce_input(node: fx.Node) -> Optional[fx.Node]:
    """``x`` when ``node``'s value is a sum all-reduce of ``x`` in one of the module docstring's
    forms (and nothing else reads the collective's intermediate nodes), else None."""
    if node.op != "call_function":
        return None
    name = op_name(node.target)
    if name == "vllm::all_reduce":
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if name in _WAITS:
        ar = node.args[0]
        if not (isinstance(ar, fx.Node) and ar.op == "call_function" and len(ar.users) == 1):
            return None
        if op_name(ar.target) in ("_c10d_functional::all_reduce", "c10d_functional::all_reduce") and _is_sum(ar.args[1]):
            return ar.args[0] if isinstance(ar.args[0], fx.Node) else None
        return None
    if is_call(node, operator.getitem) and node.args[1] == 1 and auto_functionalized_of(node.args[0], "_C::shm_allreduce"):
        af = node.args[0]
        if len(af.users) == 1:
            data = af.kwargs.get("data")
            return data if isinstance(data, fx.Node) else None
    return None


def all_reduce_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes of the all-reduce whose value ``node`` is, readers first (they die with the site)."""
    if op_name(node.target) == "vllm::all_reduce":
        return [node]
    return [node, node.args[0]]  # getitem of auto_functionalized, or wait_tensor of the all-reduce


def all_reduce_form(node: fx.Node) -> str:
    """The name of the collective behind all-reduce value ``node`` (`all_reduce_input` is not None)."""
    return collective_form(all_reduce_nodes(node)[-1]) or op_name(node.target)
