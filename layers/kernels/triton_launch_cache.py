"""Launch a ``@triton.jit`` kernel without Triton's per-call binder once its specialization has
been compiled.

``kernel[grid](*args)`` runs Triton's binder on every call: it specializes each argument
(``native_specialize_impl``), builds and hashes the cache key and looks the compiled kernel up;
for a small launch that costs more host time than the GPU spends. `CachedLauncher` launches the
first call of a specialization through ``kernel[grid](...)``, which compiles (or finds) and
returns the ``CompiledKernel``, and keeps it under `launch_key`; a later call with an equal key
launches that ``CompiledKernel`` directly (``compiled[grid](*args, stream=...)``) on the current
stream of the current device, as Triton's own launch does (so it is captured by a CUDA graph).

The key holds everything Triton's binder specializes on, read from triton 3.6.0's and 3.9.0's
``runtime/jit.py`` (``create_function_from_signature``, ``JITFunction.run``) and checked by
running 3.6.0's and 3.9.0's ``native_specialize_impl``:
  - a constexpr parameter: its value and type (``True`` and ``1`` compile differently); only
    int, bool, float, str and None constexprs are keyed;
  - a tensor: its dtype and whether ``data_ptr() % 16 == 0`` (the "D" divisibility attribute);
  - an int: whether it is 1 (then a constant), whether ``% 16 == 0``, and its type: i32 for
    ``-2**31 <= v < 2**31``, else i64 below ``2**63``, else u64; strides are plain ints;
  - a bool (u1), a float (fp32) and None (a constant None): their type;
  - num_warps, num_stages, launch_pdl (programmatic dependent launch: a compiled kernel's
    metadata carries it and its launches use it, layers/kernels/pdl.py), the current CUDA device
    and ``knobs.runtime.debug``.
Both versions launch a ``CompiledKernel`` with every parameter in signature order, constexprs
included (``CompiledKernel.__getitem__`` -> ``run(grid0, grid1, grid2, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``; the launcher skips the
constexprs), which is what `CachedLauncher.__call__` takes.

Not in the key, so they must not change after a kernel's first launch: Triton's environment
knobs other than ``debug`` (instrumentation mode, stage-inspection hooks), the kernel's source
and the globals it reads. An argument of another type (a tuple, a tensor descriptor) gives no
key and that call takes the normal launch.

Off (every call takes ``kernel[grid](...)``, logged once at debug level) when the kernel has no
parameter list or the launch returns no ``CompiledKernel``: the Triton interpreter
(``TRITON_INTERPRET=1``) is such a case.

Effects: keeps at most ``max_entries`` compiled kernels per launcher, least recently used
dropped first.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

_I32_MIN, _I32_END, _I64_END = -(1 << 31), 1 << 31, 1 << 63
_CONSTEXPR_TYPES = (int, bool, float, str, type(None))  # keyed by value; other constexprs are not keyed


def _int_tag(value: int) -> tuple[bool, bool, int]:
    """What Triton specializes an int argument on: equal to 1, divisible by 16, and its width
    (0: i32, 1: i64, 2: u64)."""
    width = 0 if _I32_MIN <= value < _I32_END else 1 if value < _I64_END else 2
    return value == 1, value % 16 == 0, width


def arg_tag(arg: Any) -> Optional[Any]:
    """The part of a non-constexpr argument that Triton's binder specializes on; None for an
    argument of a type this module does not key (the call then takes the normal launch)."""
    kind = type(arg)
    if kind is int:
        return _int_tag(arg)
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if kind is bool or kind is float or arg is None:
        return kind
    return None


def launch_key(args: Sequence[Any], constexpr: Sequence[bool], num_warps: Optional[int], num_stages: Optional[int],
               device: int, debug: bool, launch_pdl: bool = False) -> Optional[tuple]:
    """A hashable key equal for two calls only if Triton compiles them to the same kernel (the
    module docstring lists what it holds; an option given as None, Triton's default, keys apart
    from the same value given explicitly); ``constexpr[i]`` says whether parameter i is a constexpr.
    None when an argument cannot be keyed or the argument count is not the kernel's."""
    if len(args) != len(constexpr):
        return None
    key: list[Any] = [num_warps, num_stages, launch_pdl, device, debug]
    for arg, const in zip(args, constexpr):
        if const:
            if type(arg) not in _CONSTEXPR_TYPES:
                return None
            key.append((type(arg), arg))
            continue
        tag = arg_tag(arg)
        if tag is None:
            return None
        key.append(tag)
    return tuple(key)


class CachedLauncher:
    """``launcher(grid, *args, num_warps=w, num_stages=s, launch_pdl=p)`` launches ``kernel`` as
    ``kernel[grid](*args, num_warps=w, num_stages=s, launch_pdl=p)`` would (an option left None,
    or launch_pdl False, is not passed: Triton's default), ``grid`` a tuple of 1-3 ints and
    ``args`` every parameter in signature order (constexprs included), skipping the binder for a
    specialization it has seen (the module docstring). ``enabled`` False sends every call
    through the normal launch; ``hits`` counts the direct launches."""

    def __init__(self, kernel: Any, max_entries: int = 64):
        self.kernel = kernel
        self.max_entries = max_entries
        self.enabled = True
        self.hits = 0
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        from triton import knobs
        from triton.runtime.driver import driver

        self._knobs, self._driver = knobs, driver
        params = getattr(kernel, "params", None)
        self._constexpr = tuple(bool(p.is_constexpr) for p in params) if params is not None else ()
        self._off = False
        if params is None:
            self._turn_off(f"{type(kernel).__name__} has no parameter list")

    def __len__(self) -> int:
        return len(self._compiled)

    def clear(self) -> None:
        """Forget every compiled kernel (the next call of each specialization binds again)."""
        self._compiled.clear()

    def __call__(self, grid: tuple[int, ...], *args: Any, num_warps: Optional[int] = None,
                 num_stages: Optional[int] = None, launch_pdl: bool = False) -> None:
        key = None
        if self.enabled and not self._off:
            active = self._driver.active
            device = active.get_current_device()
            key = launch_key(args, self._constexpr, num_warps, num_stages, device, self._knobs.runtime.debug,
                             launch_pdl)
            compiled = self._compiled.get(key) if key is not None else None
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                full_grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
                compiled[full_grid](*args, stream=active.get_current_stream(device))
                return
        options: dict[str, Any] = {name: value for name, value in (("num_warps", num_warps), ("num_stages", num_stages))
                                   if value is not None}
        if launch_pdl:
            options["launch_pdl"] = True
        compiled = self.kernel[grid](*args, **options)
        if key is not None:
            self._remember(key, compiled)

    def _turn_off(self, reason: str) -> None:
        """Send every later call through the normal launch; logs ``reason`` once (debug)."""
        self._off = True
        logger.debug("launch cache of %s off: %s", getattr(self.kernel, "__name__", self.kernel), reason)

    def _remember(self, key: tuple, compiled: Any) -> None:
        """Keep ``compiled`` under ``key`` if it is a CompiledKernel, else turn the cache off."""
        from triton.compiler import CompiledKernel

        if not isinstance(compiled, CompiledKernel):
            self._turn_off(f"the launch returned {type(compiled).__name__}, not a CompiledKernel")
            return
        self._compiled[key] = compiled
        if len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)
