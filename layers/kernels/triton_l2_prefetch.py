"""The launch of layers/kernels/l2_prefetch.py: bulk L2 prefetches of a byte range, one chunk a
lane (sm90's ``cp.async.bulk.prefetch.L2.global``, through inline PTX: Triton has no prefetch
operation; `bulk_prefetch_l2`, which the decode-sized matmul's programs also issue before their
programmatic-dependent-launch wait). Grid: ceil(chunks / LANES) one-warp programs; nothing is
read back to the host (CUDA-graph capturable)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def bulk_prefetch_l2(ptrs, sizes):
    """For each element: ``cp.async.bulk.prefetch.L2.global [ptr], size`` (ptr 16-byte aligned,
    size in bytes a multiple of 16; none where size is 0). Returns nothing useful (zeros): the
    requests go to the SM's TMA unit, no register waits on them."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, sizes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(bytes_ptr, total_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Lane i of program p: the chunk c = p * LANES + i, bytes [c * CHUNK, min((c + 1) * CHUNK,
    total)) rounded down to a multiple of 16 (the instruction's granule); none past the end."""
    chunk = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = chunk.to(tl.int64) * CHUNK
    size = (tl.minimum(total_bytes - start, CHUNK) // 16) * 16
    bulk_prefetch_l2(bytes_ptr + start, tl.where(size > 0, size, 0))


def launch_prefetch(flat_bytes: torch.Tensor, total_bytes: int, chunk: int, lanes: int) -> None:
    """Prefetch ``total_bytes`` bytes of ``flat_bytes`` (a 1-D uint8 view of a CUDA tensor,
    16-byte aligned) into L2 in chunks of ``chunk`` bytes (a multiple of 16), ``lanes`` chunks a
    one-warp program."""
    chunks = triton.cdiv(total_bytes, chunk)
    if chunks:
        _prefetch_kernel[(triton.cdiv(chunks, lanes),)](flat_bytes, total_bytes, CHUNK=chunk, LANES=lanes, num_warps=1)
