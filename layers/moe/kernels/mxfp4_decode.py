"""MXFP4 weight tiles decoded in registers for Triton dots (layers/moe/kernels/triton_mxfp4_moe.py):
E2M1 codes two a byte (``blocks [..., K/32, 16]``, low nibble first) and an E8M0 scale byte per 32
weights (``scales [..., K/32]``), one row of W per output feature, K contiguous.

Two decoders (the kernel's `Mxfp4MoEConfig.word_decode`), both exact:

* byte decoder: a K-tile of BLOCK_K columns of BLOCK_N rows reads each row's ``BLOCK_K / 2``
  bytes ``blocks[e, n, k / 32, (k % 32) / 2]`` contiguous along k and the scales beside them; the
  low nibbles are the even-k weights, the high nibbles the odd-k ones (two dots per K-tile). Code
  c (sign bit 3, exponent bits 2..1, mantissa bit 0) placed as ``(c & 7) << 9 | (c & 8) << 12``
  is the fp16 E2M1[c] * 2^-14 (e = 0 lands on fp16's subnormals: m / 2 * 2^-14, exact).
* word decoder: the same bytes read as 32-bit words, word j of a row holding the codes of k =
  8j .. 8j + 7 (nibble q = k - 8j at bits 4q .. 4q + 3, little-endian). One word gives four
  fp16 pairs with three or two 32-bit operations each: pair q (q = 0..3) holds codes q (low half)
  and q + 4 (high half), both at bits 4q within their half, moved to bits 9..11 and 15 of each
  half by ``(w << (9 - 4q)) & 0x0E000E00 | (w << (12 - 4q)) & 0x80008000`` (a right shift by 3
  for q = 3): the same fp16 E2M1 * 2^-14 per half, at under two integer operations a weight
  instead of five. The eight residues k = 8j + r are eight dots per K-tile (K = BLOCK_K / 8 each),
  the activations loaded at the matching stride.

Either way the fp32 whose bits are ``(scale + 14) << 23`` is 2^(scale - 127) * 2^14; the fp16
weight widened to fp32 times it is the weight, exact (a 2-bit significand times a power of two),
then cast to the activations' dtype for the dot, exact for every scale byte up to 240 (2^113,
`mxfp4.KEPT_MAX_SCALE`: the experts' weight loader refuses larger ones); scale 0 (2^-127) gives
subnormal fp32 weights, as the reference does. Weight
bytes read per expert: half a byte per weight and a byte per 32, about 3.8x fewer than bf16.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def scale_factor(scales_ptr, rows, groups, mask):
    """fp32 ``2^(scale - 127) * 2^14`` of the scale bytes at ``scales_ptr + rows + groups`` (offsets
    broadcast together; masked ones give 2^-113, times a zero weight): bits ``(scale + 14) << 23``."""
    scale = tl.load(scales_ptr + rows + groups, mask=mask, other=0).to(tl.int32)
    return ((scale + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp16_half(pairs, HIGH: tl.constexpr):
    """The fp32 value of the low or high fp16 half of each 32-bit word of ``pairs``."""
    if HIGH:
        half = (pairs >> 16).to(tl.uint16)
    else:
        half = (pairs & 0xFFFF).to(tl.uint16)
    return half.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp16_halves(pairs, ASM: tl.constexpr):
    """``(low, high)``: `fp16_half` of both halves of each word of ``pairs``; with ASM one PTX block
    per word (``mov.b32 {lo, hi}`` splits the register, two ``cvt.f32.f16``), which ptxas compiles
    to one conversion per half without the byte moves of the shift-and-truncate form (the same
    values: each conversion is exact). Without ASM (the interpreter has no PTX), `fp16_half`."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=r,=r,r", [pairs], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return fp16_half(pairs, False), fp16_half(pairs, True)


@triton.jit
def load_words(w_ptr, scales_ptr, rows, row_mask, kw, k_words, stride_wn, stride_sn):
    """Word decoder's input: the 32-bit words ``kw`` (1-D, a multiple of 4 first) of ``rows``
    (``[N, KW]`` uint32, zeros past ``k_words``) and each word's scale factor (`scale_factor`).
    ``stride_wn`` (bytes) is a multiple of 16, so that rows start on 16 bytes (vector loads)."""
    words, mask = load_words_only(w_ptr, rows, row_mask, kw, k_words, stride_wn)
    return words, scale_factor(scales_ptr, rows[:, None] * stride_sn, (kw // 4)[None, :], mask)


@triton.jit
def load_words_only(w_ptr, rows, row_mask, kw, k_words, stride_wn):
    """`load_words` without the scales: ``(words [N, KW] uint32, their mask)``."""
    mask = row_mask[:, None] & (kw < k_words)[None, :]
    row_words = (rows * (stride_wn // 16))[:, None] * 4
    return tl.load(w_ptr.to(tl.pointer_type(tl.uint32)) + row_words + kw[None, :], mask=mask, other=0), mask


@triton.jit
def word_pairs(words, q: tl.constexpr):
    """Codes q (low half) and q + 4 (high half) of each word as fp16 E2M1 * 2^-14 (module
    docstring): ``(w << (9 - 4q)) & 0x0E000E00 | (w << (12 - 4q)) & 0x80008000``."""
    if q < 3:
        magnitude = words << (9 - 4 * q)
    else:
        magnitude = words >> 3
    return (magnitude & 0x0E000E00) | ((words << (12 - 4 * q)) & 0x80008000)


@triton.jit
def byte_halves(w_ptr, scales_ptr, rows, row_mask, kb0, k_size, stride_wn, stride_sn, BLOCK_K: tl.constexpr):
    """Byte decoder: the even-k and odd-k weights (fp32 ``[N, BLOCK_K / 2]``, module docstring)
    of ``rows`` over the bytes kb0 .. kb0 + BLOCK_K / 2 - 1 (kb0 a multiple of 16); each scale
    loaded once and broadcast over its 16 bytes."""
    kb = kb0 + tl.arange(0, BLOCK_K // 2)
    mask = row_mask[:, None] & (kb < k_size // 2)[None, :]
    byte = tl.load(w_ptr + rows[:, None] * stride_wn + kb[None, :], mask=mask, other=0).to(tl.uint16)
    groups = kb0 // 16 + tl.arange(0, BLOCK_K // 32)
    factor = scale_factor(scales_ptr, rows[:, None] * stride_sn, groups[None, :],
                           row_mask[:, None] & (groups < k_size // 32)[None, :])
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], [rows.shape[0], BLOCK_K // 32, 16]),
                        [rows.shape[0], BLOCK_K // 2])
    even = (((byte & 7) << 9) | ((byte & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
    odd = (((byte & 0x70) << 5) | ((byte & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    return even.to(tl.float32) * factor, odd.to(tl.float32) * factor


def expert_weight_operands(experts, word_reads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w13, s13, w2, s2)`` of a `layers.moe.gpt_oss_moe.GptOssExperts` as the experts kernels
    take them: MXFP4 blocks and scales (a row's bytes contiguous, rows at ``stride(1)``), or the
    bf16-form weights twice (no scales). ``word_reads``: the blocks are read as 16-byte vectors of
    32-bit words (`load_words`), so their start and row strides must be multiples of 16 bytes
    (ValueError otherwise)."""
    if not experts.mxfp4:
        return experts.w13_weight, experts.w13_weight, experts.w2_weight, experts.w2_weight
    w13, w2 = experts.w13_blocks, experts.w2_blocks
    if word_reads and any(t.data_ptr() % 16 or t.stride(0) % 16 or t.stride(1) % 16 for t in (w13, w2)):
        raise ValueError("the experts' MXFP4 blocks are read as 16-byte vectors of 32-bit words: their start and row "
                         "strides must be multiples of 16 bytes")
    return w13, experts.w13_scales, w2, experts.w2_scales
