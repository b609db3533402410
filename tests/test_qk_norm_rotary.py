"""Qwen3's per-head q/k RMSNorm fused into the rotary kernel that writes the KV cache
(`rotary_embedding_store_kv` with a `HeadNorm`, layers/kernels/triton_rotary.py) under Triton's
CPU interpreter, against the layer's torch path (`RotaryEmbedding.forward_store_kv` off the GPU:
`layers.layernorm.rms_norm_heads`, ``forward_torch``, ``store_kv``).

The kernels run in one spawned child with TRITON_INTERPRET=1 (the interpreter is chosen when
triton is first imported) and hand their outputs back; the checks run here. fp32 and fp16 only:
the interpreter's bf16 cast truncates (tests/gpu/test_triton_elementwise.py runs bf16 on a GPU).
Inputs: q, k, v N(0, 1) times a scale 2**U(-3, 3) per token and head (so a head normed by
another's statistics is far off), views of one packed qkv buffer (or contiguous copies), norm
weights N(1, 0.1) of q's dtype or fp32, random positions, distinct random slots of a random cache.

Tolerance, for each rotated pair (n1, n2) of the torch path's normed head: both paths compute
x * inv_rms * w in fp32 but sum the squares in other orders (and the interpreter's rsqrt is
numpy's), so the fp32 values differ by a few fp32 ulps (< 16 u, u = 2**-23, by the error bounds
of the two sums of d positive terms and of the three roundings after them); rounded to the
dtype, n may differ by one ulp of the dtype (<= eps * |n|) where it lies that close to a rounding
boundary. The rotation in fp32 (whose cos/sin differ by about an fp32 ulp between numpy and
torch) then rounds once more, which adds at most eps * |out| <= eps * (|n1| + |n2|). So

    |kernel - torch path| <= (2 * eps + 16 u) * (|n1| + |n2|) + 2 * (the dtype's smallest subnormal)

elementwise (fp16: 2 * 2**-10 + 16 * 2**-23 ~ 1.96e-3 relative; fp32: 18 u ~ 2.1e-6). That bound
would also admit a kernel that skipped the rounding of n to the dtype, so for fp16 at least 99% of
the outputs must equal the torch path's bit for bit: a normed value flips only within 16 u of a
rounding boundary, a fraction of about 16 u / eps = 2**-9 of them (the skipped rounding leaves
about two thirds bit-equal). v must be copied bit for bit and every slot not in slot_mapping left
as it was.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter

U = 2.0 ** -23
EPS = 1e-6
# (T, heads, kv_heads, head_dim, dtype, norm weight dtype, layout, slot_mapping/positions dtype);
# "packed": q, k, v views of one qkv buffer, q rotated into a new tensor; "inplace": the same, q_out=q;
# "contiguous": q, k, v copies
CASES = [
    (1, 16, 4, 128, torch.float32, torch.float32, "packed", torch.int64),
    (7, 6, 2, 64, torch.float16, torch.float16, "packed", torch.int32),
    (33, 5, 1, 128, torch.float16, torch.float32, "inplace", torch.int64),
    (5, 12, 3, 64, torch.float32, torch.float32, "contiguous", torch.int32),
    (17, 3, 3, 128, torch.float16, torch.float16, "inplace", torch.int32),
    (4, 7, 1, 96, torch.float16, torch.float16, "packed", torch.int64),  # d/2 = 48: padded to 64, masked
]


def make_case(case: tuple, seed: int) -> dict:
    """The inputs of one case (see the module docstring), the same bits on every call."""
    tokens, heads, kv_heads, d, dtype, w_dtype, layout, index_dtype = case
    g = torch.Generator().manual_seed(seed)
    total = heads + 2 * kv_heads
    scale = 2.0 ** (6 * torch.rand(tokens, total, 1, generator=g) - 3)
    qkv = (torch.randn(tokens, total, d, generator=g) * scale).view(tokens, total * d).to(dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    if layout == "contiguous":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    num_slots = 2 * tokens + 5
    return dict(
        qkv=qkv, q=q, k=k, v=v,
        positions=torch.randint(0, 2**17, (tokens,), generator=g).to(index_dtype),
        q_weight=(1 + 0.1 * torch.randn(d, generator=g)).to(w_dtype),
        k_weight=(1 + 0.1 * torch.randn(d, generator=g)).to(w_dtype),
        k_cache=torch.randn(num_slots, kv_heads, d, generator=g).to(dtype),
        v_cache=torch.randn(num_slots, kv_heads, d, generator=g).to(dtype),
        slots=torch.randperm(num_slots, generator=g)[:tokens].to(index_dtype),
    )


def _rope(head_dim: int):
    from arfusion.layers.rotary_embedding import RotaryEmbedding

    return RotaryEmbedding(head_dim, 1e6)


def _run_kernel(case: tuple, seed: int) -> dict:
    """The fused kernel on the case's inputs: its q, both caches and the qkv buffer afterwards."""
    from arfusion.layers.head_norm import HeadNorm
    from arfusion.layers.kernels.triton_rotary import rotary_embedding_store_kv

    x = make_case(case, seed)
    q_out = rotary_embedding_store_kv(x["positions"], x["q"], x["k"], x["v"], _rope(case[3]).inv_freq, x["slots"],
                                      x["k_cache"], x["v_cache"], q_out=x["q"] if case[6] == "inplace" else None,
                                      head_norm=HeadNorm(x["q_weight"], x["k_weight"], EPS))
    in_place = q_out.data_ptr() == x["q"].data_ptr()
    return dict(q_out=q_out, k_cache=x["k_cache"], v_cache=x["v_cache"], qkv=x["qkv"], q=x["q"], k=x["k"],
                v=x["v"], in_place=in_place)


def _interpreted(rank: int, world: int) -> dict:
    import triton

    assert triton.knobs.runtime.interpret, "the child must run the interpreter"
    return {case: _run_kernel(case, seed) for seed, case in enumerate(CASES)}


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


def _torch_path(case: tuple, seed: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The case's inputs, after the torch path ran on copies of its caches: ``(inputs, q_ref,
    normed k)`` with ``k_cache_ref``/``v_cache_ref`` added to the inputs."""
    from arfusion.layers.head_norm import HeadNorm
    from arfusion.layers.layernorm import rms_norm_heads

    x = make_case(case, seed)
    x["k_cache_ref"], x["v_cache_ref"] = x["k_cache"].clone(), x["v_cache"].clone()
    q_ref = _rope(case[3]).forward_store_kv(x["positions"], x["q"], x["k"], x["v"], x["slots"].long(),
                                            x["k_cache_ref"], x["v_cache_ref"],
                                            HeadNorm(x["q_weight"], x["k_weight"], EPS))  # store_kv takes int64
    x["q_normed"] = rms_norm_heads(x["q"], x["q_weight"], EPS)
    return x, q_ref, rms_norm_heads(x["k"], x["k_weight"], EPS)


def pair_magnitude(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``|x1| + |x2|`` of each element's rotation pair, shaped like ``x [T, heads * head_dim]`` (fp32)."""
    x1, x2 = x.float().reshape(x.shape[0], -1, head_dim).chunk(2, dim=-1)
    return (x1.abs() + x2.abs()).repeat(1, 1, 2).view(x.shape)


def assert_within_tolerance(name: str, out: torch.Tensor, ref: torch.Tensor, normed: torch.Tensor,
                            head_dim: int) -> None:
    """``out`` within the module docstring's bound of ``ref``, at the pairs of ``normed``, and
    (below fp32) at least 99% bit-equal to it."""
    info = torch.finfo(out.dtype)
    bound = (2 * info.eps + 16 * U) * pair_magnitude(normed, head_dim) + 2 * info.tiny * info.eps
    excess = ((out.float() - ref.float()).abs() - bound).max().item()
    assert excess <= 0, f"{name}: {excess:.3g} beyond the bound (2 eps + 16 u) (|n1| + |n2|)"
    if out.dtype != torch.float32:
        exact = (out == ref).float().mean().item()
        assert exact >= 0.99, f"{name}: only {exact:.4f} bit-equal to the torch path"


def _case_id(case: tuple) -> str:
    return "-".join(str(c).replace("torch.", "") for c in case)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("seed,case", list(enumerate(CASES)), ids=[_case_id(c) for c in CASES])
def test_fused_norm_rotary_store_kv_matches_torch_path(interpreted, seed, case):
    tokens, heads, kv_heads, d, dtype, _, layout, _ = case
    got = interpreted[case]
    x, q_ref, k_normed = _torch_path(case, seed)
    kv_cols = slice(heads * d, None)
    if layout == "inplace":
        assert got["in_place"], "q_out=q was not written in place"
        assert torch.equal(got["qkv"][:, kv_cols], x["qkv"][:, kv_cols]), "k or v was written"
    else:
        assert not got["in_place"] and got["q_out"].is_contiguous()
        for name in ("qkv", "q", "k", "v"):
            assert torch.equal(got[name], x[name]), f"input {name} was written"
    assert got["q_out"].shape == q_ref.shape and got["q_out"].dtype == dtype

    slots = x["slots"].long()
    untouched = torch.ones(x["k_cache"].shape[0], dtype=torch.bool)
    untouched[slots] = False
    for name in ("k_cache", "v_cache"):
        assert torch.equal(got[name][untouched], x[name][untouched]), f"{name}: a slot not in slot_mapping was written"
    assert torch.equal(got["v_cache"], x["v_cache_ref"]), "v is not copied bit for bit (or was normed)"
    assert_within_tolerance("q", got["q_out"], q_ref, x["q_normed"], d)
    assert_within_tolerance("k", got["k_cache"][slots].view(tokens, -1), x["k_cache_ref"][slots].view(tokens, -1),
                            k_normed, d)


def test_torch_path_norms_each_head_then_rotates_and_stores():
    """Off the GPU, `forward_store_kv` with a HeadNorm is RMSNorm per head (fusion.reference's
    math), then `forward_torch` and `store_kv`, bit for bit; v is not normed."""
    from arfusion.fusion.reference import rms_norm
    from arfusion.layers.attention import store_kv
    from arfusion.layers.head_norm import HeadNorm

    case = (5, 6, 2, 64, torch.float32, torch.float32, "packed", torch.int64)
    x = make_case(case, seed=11)
    rope = _rope(64)

    def per_head(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.stack([rms_norm(h, w, EPS) for h in t.view(5, -1, 64).unbind(1)], dim=1).view(5, -1)

    q_ref, k_rot = rope.forward_torch(x["positions"], per_head(x["q"], x["q_weight"]), per_head(x["k"], x["k_weight"]))
    k_ref, v_ref = x["k_cache"].clone(), x["v_cache"].clone()
    store_kv(k_rot, x["v"], k_ref, v_ref, x["slots"])
    q_out = rope.forward_store_kv(x["positions"], x["q"], x["k"], x["v"], x["slots"], x["k_cache"], x["v_cache"],
                                  HeadNorm(x["q_weight"], x["k_weight"], EPS))
    assert torch.equal(q_out, q_ref) and torch.equal(x["k_cache"], k_ref) and torch.equal(x["v_cache"], v_ref)


def test_bad_head_norms_raise_clear_errors():
    pytest.importorskip("triton")
    from arfusion.layers.head_norm import HeadNorm
    from arfusion.layers.kernels.triton_rotary import rotary_embedding_store_kv

    x = make_case((3, 4, 2, 64, torch.float16, torch.float16, "packed", torch.int64), seed=1)
    w = x["q_weight"]
    bad = {
        "head_norm.q_weight must be [64] of q's dtype torch.float16 or torch.float32, got (63,)": HeadNorm(w[:63], w, EPS),
        "head_norm.k_weight must be [64] of q's dtype torch.float16 or torch.float32, got (64,) torch.bfloat16":
            HeadNorm(w, w.bfloat16(), EPS),
        "head_norm.q_weight must be contiguous": HeadNorm(torch.randn(128).half()[::2], w, EPS),
        "head_norm.k_weight must be on q's device cpu, got meta": HeadNorm(w, torch.empty(64, dtype=w.dtype, device="meta"), EPS),
        "head_norm.eps must be finite and >= 0, got -1e-06": HeadNorm(w, w, -EPS),
        "head_norm.eps must be finite and >= 0, got nan": HeadNorm(w, w, math.nan),
    }
    for message, head_norm in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            rotary_embedding_store_kv(x["positions"], x["q"], x["k"], x["v"], _rope(64).inv_freq, x["slots"],
                                      x["k_cache"], x["v_cache"], head_norm=head_norm)
