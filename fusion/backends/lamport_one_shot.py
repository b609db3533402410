"""`LamportOneShotBackend`: our one-shot Lamport all-reduce + residual add + RMSNorm (the
``lamport_one_shot`` strategy) over one symmetric buffer per TP group, for decode batches.

The kernel and its ordering argument are in `fusion.backends.kernels.lamport_one_shot`; this
module lays out and initialises the buffer, compiles the kernel in ``ensure`` (so that no first
call waits out its bound for a peer that is still compiling), launches one kernel per call (no barrier, no host
sync: CUDA-graph capturable, replays rotate the three buffers on the device) and reads the
kernel's error flag when the caller asks (`raise_if_failed`).

Buffer (`LamportLayout`): ``3 * world * max_tokens * hidden`` elements of the model dtype (buffer
k, slot p: rank p's rows), then `CONTROL_INTS` int32 (index, arrivals, error, rows used by each
buffer), every data element set to the sentinel -0.0 and the control area to 0 when it is made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from arfusion.fusion.backends.base import (
    NO_ROWS,
    Backend,
    Made,
    Rows,
    output_tensors,
    quantized,
)
from arfusion.fusion.backends.kernels import row_kernel_unavailable_reason
from arfusion.fusion.backends.symmetric_buffer import SymmetricBuffer
from arfusion.fusion.errors import FusionInputError, FusionTimeoutError
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.options import FLASHINFER
from arfusion.fusion.platform import hidden_alignment_error
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy

MAX_TOKENS = 512  # decode batches: one-shot moves world x the input per rank, beyond this two-shot wins
NUM_BUFFERS = 3
DEFAULT_TIMEOUT_NS = 1_000_000_000  # 1 s: far above any legitimate skew once the kernel is compiled
CONTROL_INTS = 8  # the kernel's CONTROL layout: index 0, arrivals 1, error 2, rows 3..5; 6, 7 spare
INDEX, ARRIVALS, ERROR, ROWS = 0, 1, 2, 3
SENTINEL_BITS = {1: None, 2: 0x8000, 4: 0x80000000}  # -0.0 of a 2- and a 4-byte float, by element size


@dataclass(frozen=True)
class LamportLayout:
    """Where everything lives in one rank's buffer (offsets in elements of the model dtype,
    the control area's in int32)."""

    world: int
    max_tokens: int
    hidden: int
    element_size: int

    def slot_offset(self, buffer: int, sender: int, row: int = 0) -> int:
        """First element of ``row`` of sender ``sender``'s slot in Lamport buffer ``buffer``."""
        return ((buffer * self.world + sender) * self.max_tokens + row) * self.hidden

    @property
    def data_elements(self) -> int:
        return NUM_BUFFERS * self.world * self.max_tokens * self.hidden

    @property
    def control_offset(self) -> int:
        """int32 index of the control area (the data ends on a 16-byte boundary: rows are aligned)."""
        return math.ceil(self.data_elements * self.element_size / 4)

    @property
    def elements(self) -> int:
        """Elements of the model dtype for the data and the control area."""
        return math.ceil((self.control_offset + CONTROL_INTS) * 4 / self.element_size)


def sentinel_bits(dtype: torch.dtype) -> int:
    """The bits of -0.0 in ``dtype`` (an fp16, bf16 or fp32 dtype)."""
    bits = SENTINEL_BITS.get(dtype.itemsize) if dtype.is_floating_point else None
    if bits is None:
        raise FusionInputError(f"the Lamport kernel takes fp16, bf16 or fp32, not {dtype}")
    return bits


def lamport_unavailable_reason(device: torch.device, world: int, max_tokens: int, hidden: int,
                               dtype: torch.dtype) -> str | None:
    """None when this rank can run the kernel for ``max_tokens`` rows of ``hidden`` ``dtype``."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Lamport kernel takes fp16, bf16 or fp32, not {dtype}"
    if not 1 <= max_tokens <= MAX_TOKENS:
        return f"max_tokens {max_tokens} is outside 1..{MAX_TOKENS} (the one-shot Lamport kernel is for decode batches)"
    alignment = hidden_alignment_error(hidden, dtype)
    if alignment:
        return alignment
    if LamportLayout(world, max_tokens, hidden, dtype.itemsize).data_elements >= 2**31:
        return f"{world} ranks x {max_tokens} tokens x {hidden} hidden overflow the kernel's 32-bit offsets"
    if device.type != "cuda":
        return f"the Lamport kernel needs a CUDA device, not {device}"
    return row_kernel_unavailable_reason(hidden, "the Lamport kernel")


class LamportOneShotBackend(Backend):
    """our Triton one-shot Lamport kernel over symmetric memory, norm fused

    The one-shot Lamport fused all-reduce + residual + RMSNorm of one TP group.

    ``timeout_ns``: each call's bound on its waits for the peers (read at launch: a captured
    graph keeps the value it was captured with). A wait that expires sets the device's error
    flag; nothing raises until the caller calls `raise_if_failed` (one device -> host read: at
    the engine's existing sync points, never during graph capture). Then the backend is off on
    this rank (``fits`` False) until `destroy`."""

    strategy = Strategy.LAMPORT_ONE_SHOT
    options = (FLASHINFER,)
    made = Made.ON_DEMAND
    row_limit = MAX_TOKENS
    one_shot = True
    tuned_at_startup = True

    def __init__(self, group: TensorParallelGroup, timeout_ns: int = DEFAULT_TIMEOUT_NS) -> None:
        super().__init__(group)
        self.symmetric = SymmetricBuffer(group, "one-shot Lamport all-reduce + RMSNorm")
        self.timeout_ns = timeout_ns
        self.layout: LamportLayout | None = None
        self.timed_out: str | None = None  # why this backend is off on this rank, once a wait expired
        self._control: torch.Tensor | None = None
        self._host_error: torch.Tensor | None = None  # pinned int32 [1]: the kernel's error code, host-readable
        self._host_error_addr: torch.Tensor | None = None  # int64 [1] on the device: its address
        self._max_programs = 0
        self._pdl = False

    @property
    def ready(self) -> bool:
        return self.symmetric.buffer is not None and self.layout is not None

    @property
    def capacity(self) -> int:
        return self.layout.max_tokens if self.ready else 0

    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Collective: the buffer for ``max_tokens`` rows of ``hidden`` ``dtype``, initialised
        (sentinel data, zero control) on every rank before any rank can push; True on every rank
        or on none (``failure`` names each rank's reason). Grows only; a new hidden size or dtype
        lays the buffer out anew. Refused during CUDA-graph capture."""
        group = self.group
        if (self.ready and self.symmetric.buffer.dtype == dtype and hidden == self.layout.hidden
                and max_tokens <= self.layout.max_tokens and self.timed_out is None):
            return True
        if self.ready and hidden == self.layout.hidden and self.symmetric.buffer.dtype == dtype:
            max_tokens = max(max_tokens, self.layout.max_tokens)
        reason = (f"a wait of this backend expired earlier ({self.timed_out}); destroy() it first"
                  if self.timed_out else lamport_unavailable_reason(group.device, group.world_size, max_tokens,
                                                                    hidden, dtype))
        self.layout = None
        # voted here, not as the buffer's extra check: a buffer that is large enough is kept
        # without a vote, and every rank must see every rank's reason
        if not self.vote(lambda: reason):
            self.symmetric.destroy()
            return False
        layout = LamportLayout(group.world_size, max_tokens, hidden, dtype.itemsize)
        if not self.symmetric.ensure(layout.elements, dtype):
            self.failure = self.symmetric.failure
            return False
        if not self.vote(lambda: self._initialise(layout)):  # also the barrier: every init precedes any push
            self.symmetric.destroy()
            return False
        self.layout = layout
        return True

    def _initialise(self, layout: LamportLayout) -> None:
        """Sentinel in every data element, zeros in the control area, done on the device; the
        kernel compiled (a failure to compile is this rank's reason in the vote)."""
        buffer = self.symmetric.buffer
        bits = torch.int16 if layout.element_size == 2 else torch.int32
        sentinel = sentinel_bits(buffer.dtype)
        signed = sentinel - (1 << (8 * layout.element_size)) if sentinel >= 1 << (8 * layout.element_size - 1) else sentinel
        buffer[:layout.data_elements].view(bits).fill_(signed)
        ints = buffer.view(torch.uint8)[:layout.elements * layout.element_size]
        start = layout.control_offset * 4
        self._control = ints[start:start + CONTROL_INTS * 4].view(torch.int32)
        self._control.zero_()
        # pinned host memory is addressable from the device at the same address (unified addressing)
        self._host_error = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._host_error_addr = torch.tensor([self._host_error.data_ptr()], dtype=torch.int64, device=self.group.device)
        props = torch.cuda.get_device_properties(self.group.device)
        self._max_programs = max(1, props.multi_processor_count // self.group.ranks_on_this_gpu)
        from arfusion.fusion.backends.kernels.lamport_one_shot import (
            precompile,
            use_pdl,
        )

        self._pdl = use_pdl(self.group.device)
        precompile(layout.hidden, buffer.dtype, self.group.device, self.symmetric.peer_ptrs, self._control,
                   self._host_error_addr,
                   self.group.rank, layout.world, layout.max_tokens, self._pdl)
        torch.cuda.synchronize(self.group.device)

    def rows(self) -> Rows:
        """1 to the ensured max_tokens, while the buffer is ready and no wait expired."""
        return Rows(1, self.layout.max_tokens) if self.ready and self.timed_out is None else NO_ROWS

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant: Quant | None = None) -> FusedOutput:
        """``(rms_norm(sum(x) + residual), sum(x) + residual)`` over the group, in place (see
        `output_tensors`): ``x`` [T, H] and ``residual`` contiguous, of the ensured hidden size
        and dtype. sum(x) is the fp32 sum in rank order rounded once (the same bits on every
        rank); with FP8 ``quant`` the normed output is cast after the kernel."""
        if not self.fits(x.shape[0]):
            raise FusionInputError(f"{x.shape[0]} tokens do not fit the {self.strategy} backend "
                                   f"(capacity {self.capacity}{', off after a timeout' if self.timed_out else ''})")
        from arfusion.fusion.backends.kernels.lamport_one_shot import lamport_one_shot

        layout = self.layout
        out, residual_out = output_tensors(x, residual)
        lamport_one_shot(x, residual, out, residual_out, weight, eps, self.symmetric.peer_ptrs, self._control,
                         self._host_error_addr,
                         self.group.rank, layout.world, layout.max_tokens, int(self.timeout_ns), self._max_programs,
                         self._pdl)
        result = FusedOutput(out, residual_out)
        return result if quant is None else quantized(result, quant)

    def raise_if_failed(self) -> None:
        """Reads the pinned host copy of the kernel's error flag (a host read, no device sync: a
        kernel's code is there once that kernel has completed, e.g. once the step's results have
        reached the host). Raises `FusionTimeoutError` naming this rank, the stalled peer and
        the bound once a wait has expired, and from then on (``fits`` False: ``on_change`` is
        called once); the caller decides when to check."""
        if self.timed_out is None and self._host_error is not None:
            code = int(self._host_error[0])  # host memory: no device sync
            if code:
                self.timed_out = (f"{self.strategy}: rank {self.group.rank} waited more than "
                                  f"{self.timeout_ns / 1e6:g} ms (timeout_ns={int(self.timeout_ns)}) for rank "
                                  f"{code - 1}'s rows; its outputs are garbage and its buffers out of step")
                self.on_change()  # fits() is False from now on: the owner's plan must stop offering it
        if self.timed_out is not None:
            raise FusionTimeoutError(self.timed_out)

    def _destroy(self) -> None:
        """Frees the buffer on this rank (idempotent) and clears a timeout's mark."""
        self.symmetric.destroy()
        self.layout, self._control, self.timed_out = None, None, None
        self._host_error = self._host_error_addr = None
