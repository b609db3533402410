"""Triton kernel of the one-shot Lamport all-reduce + residual add + RMSNorm over symmetric memory.

W ranks, T tokens (1 <= T <= max_tokens), hidden H. Every rank's symmetric buffer holds three
Lamport buffers k = 0, 1, 2, each of W slots of max_tokens x H elements of the model dtype (slot
p of buffer k receives rank p's rows), then an int32 control area (layout: `CONTROL`, mirrored by
``fusion.backends.lamport_one_shot``): the current buffer index b, an arrival counter, an error
flag and, per buffer k, the rows its last call used. Every data element starts as the sentinel
-0.0 (bits 0x8000, or 0x80000000 for fp32); data never equals it because every pushed value is
-0.0 -> +0.0 sanitised (bitwise, so no compiler folds it away). One launch per call:

    grid dependency wait (PDL)
    b = index; prev = (b + 2) % 3                                 (the previous call's buffer)
    for each row i of this program:  v_i = sanitise(x[i]);  rank q's buffer b slot r [i] <- v_i,  q != r
    for each row i < rows(prev) of this program:  my buffer prev slot p [i] <- sentinel,  p != r
    for each row i of this program:
        wait until my buffer b slot p [i] holds no sentinel, for p != r in rank order (bounded)
        y_i = round(sum_{p = 0..W-1} row_p)      (fp32, rank order, own row v_i at position r)
        residual_out[i] = round(y_i + residual[i]);  out[i] = round(rmsnorm(residual_out[i]))
    arrive; the last program: arrivals = 0, rows(b) = T, index = (b + 1) % 3

Rows: program g of G takes rows g, g + G, ... (G = min(T, the host's program cap); the cap keeps
every program of every rank on a GPU resident at once, so a waiting program never holds the SM
a peer program needs to push: with ranks sharing one GPU, one program per row could fill it).

Memory ordering. Pushes are plain stores over NVLink; the waits are ``ld.volatile`` loads
(relaxed, system scope, never served from L1) of whole rows, and every element is its own
flag: a 2- or 4-byte aligned store is single-copy atomic, so an element that is not the
sentinel holds its final value, and the loaded values are the data (no second read).

Reuse (why three buffers, and why no fence). Call n writes buffer n % 3 and, while waiting,
resets buffer (n - 1) % 3, which it and every peer finished with in call n - 1 (its reads there
completed before call n started; the peers' pushes into it landed before its call n - 1 could
end). No peer writes that buffer before call n + 2, and a peer enters call n + 2 only after it
has seen this rank's pushes of call n + 1, which stream order (or the PDL wait) puts after all
of call n's resets. With two buffers the reset would race the peers' next pushes; resetting the
next call's buffer instead would need a system fence between the resets and the pushes, on the
critical path. The reset covers the rows the buffer's last call used (``rows``), so a call with
more tokens than that one never finds stale rows.

Bounded waits: every wait ends ``timeout_ns`` after the program began (``%globaltimer``). On
expiry the program records 1 + the peer's rank in the error flag (first one wins) and in a
pinned host word (read by the host at its own sync points, without a device sync), stops
waiting, finishes with garbage and arrives, so the kernel always exits; a set flag makes later
calls skip their waits (a failed op fails fast; the host reads the flag at its sync points).

PDL: launched with ``launch_pdl`` on sm90+ when this Triton has ``gdc_wait`` (Triton >= 3.4): the
launch and the programs' set-up overlap the previous kernel's tail, and ``gdc_wait`` comes
before any read of the control area, x, residual or weight (the previous kernel may be the GEMM
writing x, or our own previous call advancing the index). We never trigger dependents early:
the next kernel starts its dependent part only after this one has completed.

Why Triton over symmetric memory, not CUDA C++: the project already runs Triton kernels over
torch symmetric memory (``two_shot_norm``), peers are plain virtual addresses (``peer_ptrs``),
and Triton needs no JIT build of an extension at startup; the one thing Triton lacks, a clock,
is one line of inline PTX. Out of place or in place: ``out`` may be ``x`` and ``residual_out``
may be ``residual`` or ``x`` (a program reads its rows of x and residual before writing them;
peers never read x).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from arfusion.fusion.backends.kernels.row_norm import add_rms_norm_row, row_block, row_num_warps
WARMUP_TIMEOUT_NS = 1_000_000_000  # any value: timeout_ns is not specialised on
CONTROL = {"index": 0, "arrivals": 1, "error": 2, "rows": 3}  # int32 offsets; rows: 3 entries

HAS_GDC = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")
if HAS_GDC:
    @triton.jit
    def _grid_dependency_wait():
        tl.extra.cuda.gdc_wait()
else:  # keep tl.extra.cuda out of the kernel's AST where it does not exist
    @triton.jit
    def _grid_dependency_wait():
        pass


@triton.jit
def _now_ns():
    """The GPU's global nanosecond timer."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _buffer(peer_ptrs, rank, bits_ty: tl.constexpr):
    """Rank ``rank``'s symmetric buffer as a pointer to raw bits (16-byte aligned)."""
    return tl.multiple_of(tl.load(peer_ptrs + rank).to(tl.pointer_type(bits_ty)), 16)


@triton.jit
def _sanitised_row(x_ptr, row, hidden, cols, mask, bits_ty: tl.constexpr, SENTINEL: tl.constexpr):
    """Row ``row`` of x as bits, -0.0 replaced by +0.0 (so it never reads as "not landed")."""
    bits = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(bits_ty, bitcast=True)
    return tl.where(bits == SENTINEL, 0, bits).to(bits_ty)


@triton.jit
def _wait_row(slot_ptr, cols, mask, t0, timeout_ns, ok, SENTINEL: tl.constexpr):
    """Loads a row until no element is the sentinel, or while ``ok`` is 1 and the bound since
    ``t0`` has not passed; returns the last load and ``ok`` (0 once the bound expired)."""
    bits = tl.load(slot_ptr + cols, mask=mask, other=0, volatile=True)
    pending = tl.sum(((bits == SENTINEL) & mask).to(tl.int32), axis=0)
    while (pending > 0) & (ok != 0):
        bits = tl.load(slot_ptr + cols, mask=mask, other=0, volatile=True)
        pending = tl.sum(((bits == SENTINEL) & mask).to(tl.int32), axis=0)
        if pending > 0:
            if _now_ns() - t0 > timeout_ns:
                ok = ok * 0
    return bits, ok


@triton.jit(do_not_specialize=["tokens", "timeout_ns"])  # one compile per (dtype, hidden, residual)
def lamport_one_shot_kernel(x_ptr, residual_ptr, out_ptr, residual_out_ptr, weight_ptr, peer_ptrs, control_ptr,
                            host_error_ptr, tokens, hidden, slot_elems, eps, timeout_ns,
                            RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            USE_PDL: tl.constexpr, BITS: tl.constexpr, SENTINEL: tl.constexpr,
                            BLOCK: tl.constexpr):
    """One call (module docstring). ``control_ptr``: this rank's control area (int32);
    ``host_error_ptr``: one int64, the address of a pinned host int32 that receives the error
    code too (the host reads it without a device sync);
    ``slot_elems``: max_tokens * hidden (the offsets stay below 2**31: 3 * 8 * 512 * 16384)."""
    if USE_PDL:
        _grid_dependency_wait()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    elem_ty = x_ptr.dtype.element_ty
    b = tl.load(control_ptr + 0, volatile=True)
    prev = (b + 2) % 3
    prev_rows = tl.load(control_ptr + 3 + prev, volatile=True)
    ok = (tl.load(control_ptr + 2, volatile=True) == 0).to(tl.int32)
    t0 = _now_ns()
    mine = _buffer(peer_ptrs, RANK, BITS)

    for row in range(pid, tokens, programs):  # 1. push
        v = _sanitised_row(x_ptr, row, hidden, cols, mask, BITS, SENTINEL)
        for q in tl.static_range(WORLD):
            if q != RANK:
                dst = _buffer(peer_ptrs, q, BITS) + (b * WORLD + RANK) * slot_elems + row * hidden
                tl.store(dst + cols, v, mask=mask)

    sentinel_row = tl.full([BLOCK], SENTINEL, BITS)
    for row in range(pid, prev_rows, programs):  # 2. reset the previous call's rows
        for p in tl.static_range(WORLD):
            if p != RANK:
                tl.store(mine + (prev * WORLD + p) * slot_elems + row * hidden + cols, sentinel_row, mask=mask)

    for row in range(pid, tokens, programs):  # 3. wait, sum, add, norm
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                v = _sanitised_row(x_ptr, row, hidden, cols, mask, BITS, SENTINEL)
            else:
                before = ok
                v, ok = _wait_row(mine + (b * WORLD + p) * slot_elems + row * hidden, cols, mask, t0, timeout_ns,
                                  ok, SENTINEL)
                if (before != 0) & (ok == 0):
                    tl.atomic_cas(control_ptr + 2, 0, p + 1, sem="relaxed", scope="gpu")
                    tl.store(tl.load(host_error_ptr).to(tl.pointer_type(tl.int32)), p + 1)
            acc += v.to(elem_ty, bitcast=True).to(tl.float32)
        y = acc.to(elem_ty)
        add_rms_norm_row(y, row.to(tl.int64), residual_ptr, out_ptr, residual_out_ptr, weight_ptr, cols, mask, hidden,
                         eps, HAS_RESIDUAL)

    tl.debug_barrier()  # every thread has read b before this program arrives
    arrived = tl.atomic_add(control_ptr + 1, 1, sem="acq_rel", scope="gpu")  # 4. arrive
    if arrived == programs - 1:  # the last program: nobody of this call reads the control area again
        tl.store(control_ptr + 1, 0)
        tl.store(control_ptr + 3 + b, tokens)
        tl.store(control_ptr + 0, (b + 1) % 3)


def _pdl_launch_supported() -> bool:
    """This Triton takes ``launch_pdl`` as a launch option and has ``gdc_wait``."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return HAS_GDC and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def use_pdl(device: torch.device) -> bool:
    """PDL on sm90+ with a Triton that supports it (griddepcontrol needs sm90)."""
    return _pdl_launch_supported() and torch.cuda.get_device_capability(device)[0] >= 9


def _launch(grid: tuple[int], x: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
            residual_out: torch.Tensor, weight: torch.Tensor, eps: float, peer_ptrs: torch.Tensor,
            control: torch.Tensor, host_error: torch.Tensor, rank: int, world: int, max_tokens: int, timeout_ns: int,
            pdl: bool, warmup: bool = False) -> None:
    tokens, hidden = x.shape
    bits_ty, sentinel = (tl.int32, -2**31) if x.element_size() == 4 else (tl.int16, -2**15)
    kernel = lamport_one_shot_kernel.warmup if warmup else lamport_one_shot_kernel[grid]
    kwargs = {"grid": grid} if warmup else {}
    kernel(x, residual if residual is not None else x, out, residual_out, weight, peer_ptrs, control, host_error,
           tokens, hidden, max_tokens * hidden, eps, timeout_ns, RANK=rank, WORLD=world,
           HAS_RESIDUAL=residual is not None, USE_PDL=pdl, BITS=bits_ty, SENTINEL=sentinel,
           BLOCK=row_block(hidden), num_warps=row_num_warps(hidden),
           **({"launch_pdl": True} if pdl else {}), **kwargs)


def lamport_one_shot(x: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                     residual_out: torch.Tensor, weight: torch.Tensor, eps: float, peer_ptrs: torch.Tensor,
                     control: torch.Tensor, host_error: torch.Tensor, rank: int, world: int, max_tokens: int,
                     timeout_ns: int, max_programs: int, pdl: bool) -> None:
    """One launch on the current stream (capturable): writes ``out`` and ``residual_out``
    ([T, H], contiguous; may alias x / residual, see the module docstring). ``host_error``:
    int64 [1] on the device, the address of the pinned int32 that a wait's expiry sets."""
    _launch((min(x.shape[0], max_programs),), x, residual, out, residual_out, weight, eps, peer_ptrs, control,
            host_error, rank, world, max_tokens, timeout_ns, pdl)


def precompile(hidden: int, dtype: torch.dtype, device: torch.device, peer_ptrs: torch.Tensor,
               control: torch.Tensor, host_error: torch.Tensor, rank: int, world: int, max_tokens: int,
               pdl: bool) -> None:
    """Compiles both variants (with and without residual) without launching, so that no rank's
    first call waits for a peer that is still compiling (a compile can outlast the bound)."""
    x = torch.empty(1, hidden, dtype=dtype, device=device)
    for residual in (None, torch.empty_like(x)):
        _launch((1,), x, residual, x, x, x[0], 1e-6, peer_ptrs, control, host_error, rank, world, max_tokens,
                WARMUP_TIMEOUT_NS, pdl, warmup=True)

