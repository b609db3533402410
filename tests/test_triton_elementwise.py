"""The Triton rotary-embedding (alone, and writing the KV cache) and silu-and-mul kernels under
Triton's CPU interpreter.

Skipped when triton is not installed. As in tests/test_triton_decode_attention.py, the
interpreter must be chosen before triton is imported, so the kernel cases run in one spawned
process with TRITON_INTERPRET=1 (``run_distributed`` with one rank) and each parametrized test
checks its own case's result; host-side checks run here directly.

Each case is compared twice:
- bit for bit with the kernel's math written in torch, with the interpreter's cos/sin/exp
  (numpy's; torch's CPU libm differs from numpy's by about an fp32 ulp) and its fp32 -> bf16
  cast, which truncates (triton's interpreter ``cast_impl``) where the GPU rounds to nearest
  even. This pins every rounding step (e.g. silu rounded to the dtype before the product);
  tests/gpu/test_triton_elementwise.py checks the GPU's rounding against torch's CUDA path.
- with the layers' torch path (``forward_torch``), within a few ulps of the dtype at the
  operands' scale: a wrong head, half or sign is off by O(1).
The rotary kernel that writes the KV cache is compared bit for bit with the rotary kernel followed
by ``index_copy_`` (`layers.attention.store_kv`), and with the torch path (``forward_torch`` +
``store_kv``): q and k as above, v and every slot not written bit for bit.
"""
import re

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.activation import SiluAndMul  # noqa: E402
from arfusion.layers.attention import store_kv  # noqa: E402
from arfusion.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from arfusion.layers.kernels.triton_activation import silu_and_mul  # noqa: E402
from arfusion.layers.kernels.triton_rotary import rotary_embedding, rotary_embedding_store_kv  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
_BITS_AS_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SCALINGS = {"llama3": LLAMA3, "default": None}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (shared) dtype lie between a and b, elementwise
    (0 where bit-equal; +0 and -0 are 0 apart)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    bits = 8 * a.element_size()

    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.view(_BITS_AS_INT[x.dtype]).long()
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    return (ordered(a) - ordered(b)).abs()


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def pair_magnitude(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``|x1| + |x2|`` of each output element's rotation pair, shaped like x (fp32)."""
    heads = x.float().view(x.shape[0], -1, head_dim)
    x1, x2 = heads.chunk(2, dim=-1)
    return (x1.abs() + x2.abs()).repeat(1, 1, 2).view(x.shape)


def interpreter_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` to ``dtype`` as the interpreter casts: bf16 by truncating the low 16 bits,
    fp16 rounded to nearest even (numpy)."""
    if dtype == torch.bfloat16:
        x = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # exactly representable: .to is exact
    return x.to(dtype)


def rotary_as_interpreted(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The rotation with numpy's cos/sin of the fp32 angles, each product and sum in fp32, one cast."""
    angles = (positions.to(torch.float32)[:, None] * rope.inv_freq[None, :]).numpy()
    cos, sin = torch.from_numpy(np.cos(angles))[:, None, :], torch.from_numpy(np.sin(angles))[:, None, :]
    x1, x2 = x.float().view(x.shape[0], -1, rope.head_dim).chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return interpreter_cast(out, x.dtype).view(x.shape)


def silu_and_mul_as_interpreted(x: torch.Tensor) -> torch.Tensor:
    """silu in fp32 with numpy's exp, cast to the dtype, times up in fp32, cast."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    silu = gate / (1 + torch.from_numpy(np.exp(-gate.numpy())))
    return interpreter_cast(interpreter_cast(silu, x.dtype).float() * up, x.dtype)


def make_rotary_case(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, layout: str,
                     pos_dtype: torch.dtype, seed: int):
    """Random q, k (views of a packed [T, (H + 2 KVH) * d] qkv for "packed" and "inplace", own
    tensors for "contiguous"), positions in [0, 2**17) with position 0 first."""
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    if layout == "contiguous":
        q, k = q.contiguous(), k.contiguous()
    positions = torch.randint(0, 2**17, (tokens,), generator=g)
    positions[0] = 0
    return qkv, q, k, positions.to(pos_dtype)


# (T, heads, kv_heads, head_dim, dtype, layout, theta, SCALINGS key, positions dtype)
ROTARY_CASES = [
    (1, 16, 4, 128, torch.float32, "packed", 500000.0, "llama3", torch.int64),
    (5, 4, 1, 64, torch.float32, "contiguous", 10000.0, "default", torch.int64),
    (33, 16, 4, 128, torch.float32, "inplace", 500000.0, "llama3", torch.int32),
    (33, 1, 1, 64, torch.float16, "packed", 10000.0, "default", torch.int64),
    (5, 16, 4, 128, torch.float16, "inplace", 500000.0, "llama3", torch.int64),
    (1, 4, 4, 64, torch.bfloat16, "contiguous", 1e6, "default", torch.int64),
    (33, 16, 4, 128, torch.bfloat16, "packed", 500000.0, "llama3", torch.int64),
    (5, 6, 2, 96, torch.bfloat16, "inplace", 10000.0, "default", torch.int32),  # d/2 = 48: padded to 64, masked
]

# (T, heads, kv_heads, head_dim, dtype, layout, theta, SCALINGS key, positions and slot_mapping dtype);
# "packed": q, k, v views of a packed qkv, q rotated into a new tensor; "inplace": the same, q_out=q
ROTARY_KV_CASES = [
    (1, 16, 4, 128, torch.bfloat16, "packed", 500000.0, "llama3", torch.int64),
    (7, 4, 1, 64, torch.float32, "contiguous", 10000.0, "default", torch.int32),
    (33, 16, 4, 128, torch.float16, "inplace", 500000.0, "llama3", torch.int64),
    (33, 8, 8, 64, torch.float32, "inplace", 1e6, "default", torch.int64),
    (5, 4, 4, 64, torch.float16, "contiguous", 10000.0, "default", torch.int64),
    (5, 6, 2, 96, torch.bfloat16, "packed", 10000.0, "default", torch.int32),  # d/2 = 48: padded to 64, masked
    (33, 16, 4, 128, torch.bfloat16, "inplace", 500000.0, "llama3", torch.int32),
]

# (leading shape, d, dtype, row layout); "strided": rows of a wider buffer
SILU_CASES = [
    ((1,), 7168, torch.float32, "contiguous"),
    ((5,), 300, torch.float32, "strided"),
    ((33,), 1000, torch.float16, "contiguous"),
    ((2, 3), 1024, torch.float16, "contiguous"),
    ((1,), 7168, torch.bfloat16, "contiguous"),
    ((33,), 2500, torch.bfloat16, "strided"),
]


def make_silu_input(lead: tuple, d: int, dtype: torch.dtype, layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if layout == "strided":
        wide = (3 * torch.randn(*lead, 2 * d + 40, generator=g)).to(dtype)
        return wide[..., 20:20 + 2 * d]
    return (3 * torch.randn(*lead, 2 * d, generator=g)).to(dtype)


def _run_rotary_case(case) -> None:
    tokens, heads, kv_heads, head_dim, dtype, layout, theta, scaling, pos_dtype = case
    rope = RotaryEmbedding(head_dim, theta, SCALINGS[scaling])
    qkv, q, k, positions = make_rotary_case(tokens, heads, kv_heads, head_dim, dtype, layout, pos_dtype,
                                            seed=tokens * 1000 + heads * 10 + head_dim)
    before = qkv.clone()
    q_in, k_in = q.clone(), k.clone()
    if layout == "inplace":
        q_out, k_out = rotary_embedding(positions, q, k, rope.inv_freq, q_out=q, k_out=k)
        assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "not in place"
        v_cols = slice((heads + kv_heads) * head_dim, None)
        assert torch.equal(qkv[:, v_cols], before[:, v_cols]), "v was written"
    else:
        q_out, k_out = rotary_embedding(positions, q, k, rope.inv_freq)
        assert torch.equal(qkv, before), "inputs were written"
        assert q_out.is_contiguous() and k_out.is_contiguous()
    for name, out, x in (("q", q_out, q_in), ("k", k_out, k_in)):
        assert out.shape == x.shape and out.dtype == dtype, (name, out.shape, out.dtype)
        ulps = ulp_distance(out, rotary_as_interpreted(rope, positions, x)).max().item()
        assert ulps == 0, f"{name}: {ulps} ulps from the same math as interpreted"
        torch_ref = rope.forward_torch(positions, q_in, k_in)[0 if name == "q" else 1]
        err = (out.float() - torch_ref.float()).abs() / pair_magnitude(x, head_dim).clamp_min(1e-30)
        assert err.max().item() <= 2 * eps(dtype), f"{name}: error {err.max().item():.3g} x |x1|+|x2| vs forward_torch"


def make_kv_cache_case(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, index_dtype: torch.dtype,
                       seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K and V caches of 2T + 5 slots and T distinct random slots to write."""
    g = torch.Generator().manual_seed(seed)
    num_slots = 2 * tokens + 5
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    return k_cache, v_cache, torch.randperm(num_slots, generator=g)[:tokens].to(index_dtype)


def _run_rotary_store_kv_case(case) -> None:
    tokens, heads, kv_heads, head_dim, dtype, layout, theta, scaling, index_dtype = case
    rope = RotaryEmbedding(head_dim, theta, SCALINGS[scaling])
    seed = tokens * 1000 + heads * 10 + head_dim + 1
    qkv, q, k, positions = make_rotary_case(tokens, heads, kv_heads, head_dim, dtype,
                                            "contiguous" if layout == "contiguous" else "packed", index_dtype, seed)
    v = qkv[:, (heads + kv_heads) * head_dim:]
    v = v.contiguous() if layout == "contiguous" else v
    k_cache, v_cache, slots = make_kv_cache_case(tokens, kv_heads, head_dim, dtype, index_dtype, seed)
    qkv_before, k_cache_before, v_cache_before = qkv.clone(), k_cache.clone(), v_cache.clone()
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()

    q_out = rotary_embedding_store_kv(positions, q, k, v, rope.inv_freq, slots, k_cache, v_cache,
                                      q_out=q if layout == "inplace" else None)
    if layout == "inplace":
        assert q_out.data_ptr() == q.data_ptr(), "not in place"
        kv_cols = slice(heads * head_dim, None)
        assert torch.equal(qkv[:, kv_cols], qkv_before[:, kv_cols]), "k or v was written"
    else:
        assert torch.equal(qkv, qkv_before), "inputs were written"
        assert q_out.is_contiguous() and q_out.shape == q.shape and q_out.dtype == dtype

    q_kernel, k_kernel = rotary_embedding(positions, q_in, k_in, rope.inv_freq)
    k_unfused, v_unfused = k_cache_before.clone(), v_cache_before.clone()
    store_kv(k_kernel, v_in, k_unfused, v_unfused, slots.long())
    assert torch.equal(q_out, q_kernel), "q differs from the rotary kernel's"
    assert torch.equal(k_cache, k_unfused), "k_cache differs from the rotary kernel + index_copy_"
    assert torch.equal(v_cache, v_unfused), "v_cache differs from index_copy_"

    q_ref, k_ref = rope.forward_torch(positions, q_in, k_in)
    k_torch, v_torch = k_cache_before.clone(), v_cache_before.clone()
    store_kv(k_ref, v_in, k_torch, v_torch, slots.long())
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(k_cache[untouched], k_cache_before[untouched]), "a slot not in slot_mapping was written (k)"
    assert torch.equal(v_cache[untouched], v_cache_before[untouched]), "a slot not in slot_mapping was written (v)"
    assert torch.equal(v_cache, v_torch), "v is not copied bit for bit"
    written = k_cache[slots.long()].view(tokens, -1)
    for name, out, ref, x in (("q", q_out, q_ref, q_in), ("k", written, k_torch[slots.long()].view(tokens, -1), k_in)):
        err = (out.float() - ref.float()).abs() / pair_magnitude(x, head_dim).clamp_min(1e-30)
        assert err.max().item() <= 2 * eps(dtype), f"{name}: error {err.max().item():.3g} x |x1|+|x2| vs forward_torch"


def _run_silu_case(case) -> None:
    lead, d, dtype, layout = case
    x = make_silu_input(lead, d, dtype, layout, seed=d + len(lead))
    x_before = x.clone()
    out = silu_and_mul(x)
    assert torch.equal(x, x_before), "input was written"
    assert out.shape == lead + (d,) and out.dtype == dtype and out.is_contiguous(), (out.shape, out.dtype)
    ulps = ulp_distance(out, silu_and_mul_as_interpreted(x)).max().item()
    assert ulps == 0, f"{ulps} ulps from the same math as interpreted"
    torch.testing.assert_close(out, SiluAndMul().forward_torch(x), rtol=4 * eps(dtype), atol=0)


def _interpreted_cases(rank: int, world_size: int) -> dict:
    """In the TRITON_INTERPRET=1 child: every case; per key None when it passed, else the message."""
    import triton

    assert triton.knobs.runtime.interpret, "the child must run the interpreter"
    results = {}
    for kind, cases, run in (("rotary", ROTARY_CASES, _run_rotary_case), ("silu", SILU_CASES, _run_silu_case),
                             ("rotary_store_kv", ROTARY_KV_CASES, _run_rotary_store_kv_case)):
        for case in cases:
            try:
                run(case)
                results[(kind, case)] = None
            except AssertionError as e:
                results[(kind, case)] = str(e)
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted_cases)


def _case_id(case) -> str:
    return "-".join("x".join(map(str, c)) if isinstance(c, tuple) else str(c).replace("torch.", "") for c in case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ROTARY_CASES, ids=_case_id)
def test_rotary_matches_torch_path(interpreted, case):
    assert interpreted[("rotary", case)] is None, interpreted[("rotary", case)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ROTARY_KV_CASES, ids=_case_id)
def test_rotary_store_kv_matches_unfused_kernel_and_torch_path(interpreted, case):
    assert interpreted[("rotary_store_kv", case)] is None, interpreted[("rotary_store_kv", case)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", SILU_CASES, ids=_case_id)
def test_silu_and_mul_matches_torch_path(interpreted, case):
    assert interpreted[("silu", case)] is None, interpreted[("silu", case)]


def test_ulp_distance_counts_representable_steps():
    steps = torch.tensor([1.0, 1.0078125, -1.0, 0.0, -0.0], dtype=torch.bfloat16)
    base = torch.tensor([1.0, 1.0, 1.0, -0.0, 0.0], dtype=torch.bfloat16)
    assert ulp_distance(steps, base).tolist() == [0, 1, 2 * 0x3F80, 0, 0]


def test_bad_rotary_inputs_raise_clear_errors():
    rope = RotaryEmbedding(64, 10000.0)
    _, q, k, positions = make_rotary_case(3, 4, 2, 64, torch.float32, "packed", torch.int64, seed=1)
    bad = {
        "1-D int32 or int64": dict(positions=positions.float()),
        "contiguous 1-D fp32": dict(inv_freq=rope.inv_freq.half()),
        "share one dtype": dict(k=k.half()),
        "heads * 64": dict(q=q[:, :100]),
        "contiguous last dimension": dict(k=k.t().contiguous().t()),
        "match its input": dict(q_out=torch.empty(3, 4 * 64, dtype=torch.float16)),
    }
    for message, override in bad.items():
        args = dict(positions=positions, q=q, k=k, inv_freq=rope.inv_freq) | override
        with pytest.raises(ValueError, match=re.escape(message)):
            rotary_embedding(**args)


def test_bad_rotary_store_kv_inputs_raise_clear_errors():
    rope = RotaryEmbedding(64, 10000.0)
    qkv, q, k, positions = make_rotary_case(3, 4, 2, 64, torch.float32, "packed", torch.int64, seed=1)
    v = qkv[:, 6 * 64:]
    k_cache, v_cache, slots = make_kv_cache_case(3, 2, 64, torch.float32, torch.int64, seed=1)
    bad = {
        "v must match k": dict(v=v.half()),
        "slot_mapping must be a contiguous 1-D int32 or int64 tensor of T=3": dict(slot_mapping=slots[:2]),
        "int32 or int64 tensor": dict(slot_mapping=slots.float()),
        "k_cache must be [num_slots, 2, 64]": dict(k_cache=k_cache[:, :1]),
        "v_cache must be [num_slots, 2, 64] torch.float32": dict(v_cache=v_cache.half()),
        "each slot's heads contiguous": dict(k_cache=k_cache.transpose(0, 1).contiguous().transpose(0, 1)),
        "positions must be a contiguous": dict(positions=torch.stack([positions, positions], 1)[:, 0]),
    }
    for message, override in bad.items():
        args = dict(positions=positions, q=q, k=k, v=v, inv_freq=rope.inv_freq, slot_mapping=slots,
                    k_cache=k_cache, v_cache=v_cache) | override
        with pytest.raises(ValueError, match=re.escape(message)):
            rotary_embedding_store_kv(**args)


def test_rotary_store_kv_dispatch_off_gpu_is_the_torch_path():
    """Off the GPU `forward_store_kv` is `forward_torch` then `store_kv`, exactly."""
    rope = RotaryEmbedding(64, 10000.0, LLAMA3)
    qkv, q, k, positions = make_rotary_case(5, 4, 2, 64, torch.float32, "packed", torch.int64, seed=2)
    v = qkv[:, 6 * 64:]
    k_cache, v_cache, slots = make_kv_cache_case(5, 2, 64, torch.float32, torch.int64, seed=2)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref, k_rot = rope.forward_torch(positions, q, k)
    store_kv(k_rot, v, k_ref, v_ref, slots)
    q_out = rope.forward_store_kv(positions, q, k, v, slots, k_cache, v_cache)
    assert torch.equal(q_out, q_ref) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_bad_silu_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        silu_and_mul(torch.randn(8, 2).t())


def test_no_tokens_launch_nothing():
    rope = RotaryEmbedding(64, 10000.0)
    q, k = torch.empty(0, 4 * 64), torch.empty(0, 64)
    q_out, k_out = rotary_embedding(torch.empty(0, dtype=torch.int64), q, k, rope.inv_freq)
    assert q_out.shape == (0, 256) and k_out.shape == (0, 64)
    assert silu_and_mul(torch.empty(0, 16)).shape == (0, 8)
    k_cache, v_cache = torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = rotary_embedding_store_kv(torch.empty(0, dtype=torch.int64), q, k, k, rope.inv_freq,
                                      torch.empty(0, dtype=torch.int64), k_cache, v_cache)
    assert q_out.shape == (0, 256) and torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
