"""Triton kernels compiled for a GPU on a machine without one: the launches a function makes are
recorded instead of run, then each is compiled for sm90 (triton's NVIDIA backend and the ptxas
of its wheel) with the specialisation a launch on the GPU would get, and its TTGIR is read (the
tensor-core instruction of each dot, the layout of each reduction)."""
from __future__ import annotations

import re
from typing import Any, Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)


class RecordedKernel:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](*args, **kwargs)`` records the
    call in ``calls`` and runs nothing."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def compiled_asm(fn: Any, args: tuple, kwargs: dict, target: GPUTarget = SM90) -> dict[str, Any]:
    """The stages (``"ttgir"``, ``"ptx"``, ...) of ``fn`` (``@triton.jit`` or ``@gluon.jit``) launched
    with ``args`` / ``kwargs``
    (tensors may live on the CPU: only their dtypes and the alignment of their addresses matter),
    compiled for ``target``."""
    backend = make_backend(target)
    kwargs = {**kwargs, "debug": False}
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a @gluon.jit function
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__).asm


def ttgir(fn: Any, args: tuple, kwargs: dict, target: GPUTarget = SM90) -> str:
    """The TTGIR of `compiled_asm`, without location comments."""
    text = re.sub(r" loc\([^)]*\)", "", compiled_asm(fn, args, kwargs, target)["ttgir"])
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def mma_versions(ir: str) -> list[int]:
    """The tensor-core instruction family of every MMA layout: 2 mma.sync, 3 wgmma."""
    return [int(v) for v in re.findall(r"#ttg\.nvidia_mma<\{versionMajor = (\d)", ir)]


def dot_k_extents(ir: str) -> list[int]:
    """The K extent of every dot (``tt.dot``: mma.sync, ``ttng.warp_group_dot``: wgmma) in a
    TTGIR: its A operand's columns, i.e. one BLOCK_K step of the K loop."""
    dot = r"(?:tt\.dot|ttng\.warp_group_dot) .*? : (?:tensor|!ttg\.memdesc)<\d+x(\d+)x"
    return [int(k) for k in re.findall(dot, ir)]


def ptx_mma_k(ptx: str) -> set[int]:
    """The k of every tensor-core instruction in a PTX (``mma.sync.aligned.m16n8k16...``,
    ``wgmma.mma_async.sync.aligned.m64n64k16...``): the chunk of K one instruction sums."""
    return {int(k) for k in re.findall(r"\b(?:mma\.sync|wgmma\.mma_async\.sync)\.aligned\.m\d+n\d+k(\d+)", ptx)}


def add_reduction_layouts(ir: str) -> list[str]:
    """For every floating-point sum reduction (``tt.reduce`` combining by ``arith.addf``), its
    operand's shape and layout, in program order: the order of its additions is fixed by these."""
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.M))
    found = []
    for m in re.finditer(r'"tt\.reduce"\(.*?\n(.*?)\}\) : \((tensor<.*?>)\) ->', ir, re.S):
        if "arith.addf" in m.group(1):
            shape, layout = re.fullmatch(r"tensor<([^,]*), (.*)>", m.group(2)).groups()
            found.append(f"{shape} {layouts.get(layout, layout)}")
    return found
