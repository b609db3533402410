"""Programmatic dependent launch (PDL) of the Triton kernels of a decode step: the switch, and the
rules every kernel launched with it keeps.

Between two kernels on one stream the GPU idles: the second's blocks are scheduled only once
the first has completed and its writes are flushed. A kernel launched with PDL (sm90 and newer;
Triton's launch option ``launch_pdl=True``, which sets CUDA's programmatic stream serialization
attribute) may have its blocks scheduled while its predecessor still runs, as soon as every block
of the predecessor has executed ``griddepcontrol.launch_dependents``
(``tl.extra.cuda.gdc_launch_dependents()``) or exited; its blocks then stop at
``griddepcontrol.wait`` (``tl.extra.cuda.gdc_wait()``) until the predecessor has completed and
its writes are visible. Its launch and its prologue, and whatever it may load before the wait,
overlap the predecessor's tail.

The kernels that take part are those of a decode step: the decode-sized matmul (the o
projection; through its launch cache, whose key holds launch_pdl), the input norm inside q/k/v
(layers/kernels/triton_norm_matmul.py, with ``--norm-into-qkv``), rotary + q/k norm + KV store,
decode attention's split kernel (and its combine kernel where it runs), the one-launch
routing (also with the post-attention norm inside, ``--norm-into-route``: it reads x and the residual after the wait),
and the matrix-vector MoE experts (bf16: layers/moe/kernels/triton_moe_gemv.py; MXFP4:
triton_mxfp4_gemv.py, and the combine launch after them, alone or with the next add + RMSNorm:
layers/moe/kernels/triton_topk_combine.py, which loads the norm weight before the wait). Each has a
``USE_PDL: tl.constexpr`` parameter and is launched with ``USE_PDL=on, launch_pdl=on``, the two
always equal (``on = enabled()``). With USE_PDL it keeps these rules:

1. Every program calls ``gdc_wait()`` before it reads anything an earlier kernel of the step may
   write (activations, the KV cache, routing, positions and sequence lengths, scratch,
   counters), and before it writes anything: what it writes may still be read by the
   predecessor (a new tensor may be memory the caching allocator has just taken back from one).
   Only data that no kernel writes during a step (weights, biases, norm weights, the rotary
   inverse frequencies) may be loaded before the wait: the routing launch loads its first weight
   tile there, and the decode-sized matmul asks L2 for its first K steps (bulk prefetches). The
   one exception: what a kernel before the predecessor wrote and the predecessor does not write.
   By rule 2 every program of the predecessor has passed its own wait before this kernel's
   programs are scheduled (a predecessor launched without PDL has started, so its own
   predecessor has completed), so every kernel before it has completed and its writes are
   visible. The experts' per-slot down launches use it (bf16 and MXFP4 matrix-vector launches,
   ``early_weights``): the slot's expert id, written by the routing before the gate/up launch,
   and the first K step of that expert's weights, loaded while the gate/up launch still runs.
2. ``gdc_launch_dependents()`` right after the wait. Early is safe: the dependent's blocks are
   scheduled only once every block of this kernel has executed it or exited, so all of them are
   resident by then and a dependent block waiting at its own ``gdc_wait`` cannot keep one of
   them from being scheduled.
3. The wait is on every program's path, before any exit: no PDL kernel completes before its
   predecessor has, so ordering is transitive (after its wait a kernel sees the writes of every
   earlier kernel of the stream, not only of the one before it). A kernel launched without PDL
   (cuBLAS, torch, or these with the switch off) waits for its predecessor's completion as
   always.

flashinfer 0.7.2 launches its RMSNorm and fused add-RMSNorm kernels (fusion/norm.py) with PDL
on sm90 whatever this switch says (their ``enable_pdl`` default), keeping the same rules: each
block waits first and lets its dependents launch after its stores. So the norms between the o
projection, the routing and the next layer's q/k/v stay in the chain; cuBLAS's q/k/v and
gate/up break it (the q/k/v on the decode-sized matmul launch instead, to keep the chain, was
slower: docs/results.md).

With USE_PDL False a kernel compiles without the two instructions (the Triton interpreter,
``TRITON_INTERPRET=1``, has none and raises on them; below sm90 they do not exist). The
arithmetic does not change either way: PDL moves when a kernel starts, not what it computes, so
every output has the same bits with the switch on or off, and batch-invariant mode
(``--deterministic``) keeps it on.

By default the switch is on for decode steps of at most ``--pdl-max-batch`` sequences (1) at TP
size 1 where PDL can run, and off elsewhere (the runner logs why: `engine.runtime.model_runner.
pdl_decode_bound`). ``--enable-pdl`` (`RunnerSettings.enable_pdl`, on every TP rank) has each
rank refuse to start where PDL cannot run (`require_supported`: a ValueError naming the reason,
which fails the launch on every rank) and its runner turn the switch on around each forward and
each CUDA-graph capture (`pdl_mode`), as batch-invariant mode is (CUDA's stream capture records
a PDL launch as a programmatic dependency between the two kernels, which every replay keeps).
"""
from __future__ import annotations

from typing import ContextManager, Optional

import torch

from arfusion.layers.kernels.process_switch import ProcessSwitch
from arfusion.layers.kernels.triton_support import triton_available

_MODE = ProcessSwitch()


def enabled() -> bool:
    """Whether the kernels that take part launch with PDL now (``USE_PDL`` and ``launch_pdl``)."""
    return _MODE.on


def pdl_mode(on: bool) -> ContextManager[None]:
    """The switch on (or off) inside a ``with`` block; the previous setting is restored. Checks
    nothing: whoever turns it on has called `require_supported` for the device once."""
    return _MODE.scoped(on)


def unsupported_reason(device: torch.device) -> Optional[str]:
    """Why the kernels cannot launch with PDL on ``device``; None when they can (an NVIDIA GPU
    of compute capability 9.0 or newer, triton installed, its interpreter off)."""
    if not triton_available():
        return "triton is not installed (the kernels launched with PDL are Triton kernels)"
    import triton

    if triton.knobs.runtime.interpret:
        return "Triton's interpreter (TRITON_INTERPRET=1) runs no griddepcontrol instructions"
    if device.type != "cuda":
        return f"the device is {device}, not a CUDA GPU"
    if torch.version.hip is not None:
        return "the GPU is an AMD GPU; programmatic dependent launch is NVIDIA's (sm90 and newer)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"{torch.cuda.get_device_name(device)} is sm{major}{minor}; PDL needs sm90 (Hopper) or newer"
    return None


def require_supported(device: torch.device) -> None:
    """ValueError naming the reason when the kernels cannot launch with PDL on ``device``."""
    reason = unsupported_reason(device)
    if reason is not None:
        raise ValueError(f"--enable-pdl: {reason}")
