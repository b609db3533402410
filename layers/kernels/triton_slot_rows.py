"""The one Triton helper the attention kernels share: where sequence b's slots start in the
request-to-token table (its row ``row_ids[b]`` of a whole table, or row b of a gathered one)."""
import triton
import triton.language as tl


@triton.jit
def sequence_slot_row(ReqToToken, RowIds, b, stride_rb, HAS_ROW_IDS: tl.constexpr):
    """Pointer to sequence b's row of ``ReqToToken``: row ``RowIds[b]`` with ``HAS_ROW_IDS``
    (RowIds is unused otherwise), else row b."""
    if HAS_ROW_IDS:
        row = tl.load(RowIds + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    return ReqToToken + row * stride_rb
