"""The Triton rotary-embedding (alone, and writing the KV cache) and silu-and-mul kernels on one
GPU, at llama3-8b TP2 shapes (16 query heads, 4 KV heads, head_dim 128, intermediate 7168 per
rank), bf16 and fp16.

Against the layers' torch path (``forward_torch``): the kernels use the same libdevice
cos/sin/exp and the same rounding steps, so they should agree bit for bit; asserted are at least
99% bit-equal elements (the fraction is printed with ``-s``) and, for the rest, rotary within one
ulp of the dtype at the scale |x1| + |x2| of the rotated pair (where cancellation cannot inflate
it), silu_and_mul within two ulps.
The rotary kernel that writes the KV cache must equal the torch path (``forward_torch`` +
``store_kv``) bit for bit: q, and both whole caches (v copied, untouched slots untouched); it
agreed on 100% of the rotary kernel's outputs (docs/results/engine_gpu_tests.log).
With a `HeadNorm` (Qwen3's per-head q/k RMSNorm, fused into that kernel) against the torch path
with `fusion.reference.rms_norm` per head: the sum of squares runs in another order, so q and k
within the bound of tests/test_qk_norm_rotary.py ((2 eps + 16 u) (|n1| + |n2|) of the normed
pair) and at least 99% bit-equal, v and the untouched slots bit for bit; a token's bits the same
at every T (batch-invariant).
Then the ops through the layers' dispatch, captured in one CUDA graph and replayed with new
inputs; then a µs-per-call table against the torch path.
"""
from typing import Callable

import pytest
import torch

from arfusion.fusion.reference import rms_norm
from arfusion.fusion.tuning.timing import capture_cuda_graph, median_us_per_call

pytest.importorskip("triton")

from arfusion import layers  # noqa: E402  (the modules imported below, patched through it by name)
from arfusion.layers.activation import SiluAndMul  # noqa: E402
from arfusion.layers.attention import store_kv  # noqa: E402
from arfusion.layers.head_norm import HeadNorm  # noqa: E402
from arfusion.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from arfusion.layers.kernels.triton_activation import silu_and_mul  # noqa: E402
from arfusion.layers.kernels.triton_rotary import rotary_embedding, rotary_embedding_store_kv  # noqa: E402
from tests.test_qk_norm_rotary import assert_within_tolerance  # noqa: E402
from tests.test_triton_elementwise import LLAMA3, eps, pair_magnitude, ulp_distance  # noqa: E402

pytestmark = pytest.mark.gpus(1)

HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 16, 4, 128, 7168
QKV_WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM
TOKENS = (1, 32, 256, 4096)
DEVICE = torch.device("cuda", 0)


def _rope() -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, 500000.0, LLAMA3, device=DEVICE)


def _split(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v views of a packed qkv projection output, as QKVParallelLinear.split makes them."""
    return qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)


def _fill(positions: torch.Tensor, qkv: torch.Tensor, x: torch.Tensor, seed: int) -> None:
    """New random contents in place: positions in [0, 2**17) (llama3-8b's 128K context), qkv and
    the gate/up activations with std 2 and 3."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    positions.copy_(torch.randint(0, 2**17, positions.shape, generator=gen, device=DEVICE))
    qkv.copy_(2 * torch.randn(qkv.shape, generator=gen, device=DEVICE))
    x.copy_(3 * torch.randn(x.shape, generator=gen, device=DEVICE))


def _fill_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, seed: int) -> None:
    """New random caches and distinct random slots to write, in place."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen, device=DEVICE))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen, device=DEVICE))
    slots.copy_(torch.randperm(k_cache.shape[0], generator=gen, device=DEVICE)[:slots.shape[0]])


def _kv_case(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K and V caches of 2T + 5 slots and T distinct slots to write."""
    k_cache = torch.empty(2 * tokens + 5, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_cache, slots = torch.empty_like(k_cache), torch.empty(tokens, dtype=torch.int64, device=DEVICE)
    _fill_kv(k_cache, v_cache, slots, seed)
    return k_cache, v_cache, slots


def _rotary_store_kv_torch(rope: RotaryEmbedding, positions, q, k, v, slots, k_cache, v_cache) -> torch.Tensor:
    """The torch path: rotated q; writes the rotated k and v into the caches."""
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    store_kv(k_ref, v, k_cache, v_cache, slots)
    return q_ref


def _head_norm(dtype: torch.dtype, seed: int) -> HeadNorm:
    """q and k norm weights N(1, 0.1) in ``dtype``, eps 1e-6 (Qwen3's)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    weights = 1 + 0.1 * torch.randn(2, HEAD_DIM, generator=gen, device=DEVICE)
    return HeadNorm(weights[0].to(dtype), weights[1].to(dtype), 1e-6)


def _norm_torch(x: torch.Tensor, weight: torch.Tensor, eps_: float) -> torch.Tensor:
    """`fusion.reference.rms_norm` of every head of ``x [T, heads * HEAD_DIM]``: a new tensor."""
    return rms_norm(x.reshape(-1, HEAD_DIM), weight, eps_).view(x.shape)


def _norm_rotary_store_kv_torch(rope: RotaryEmbedding, positions, q, k, v, slots, k_cache, v_cache,
                                head_norm: HeadNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path with the head norms: ``(rotated q, normed q, normed k)``; writes the rotated
    normed k and v into the caches."""
    q_normed, k_normed = _norm_torch(q, head_norm.q_weight, head_norm.eps), _norm_torch(k, head_norm.k_weight, head_norm.eps)
    return _rotary_store_kv_torch(rope, positions, q_normed, k_normed, v, slots, k_cache, v_cache), q_normed, k_normed


def _assert_bit_equal(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    ulps = ulp_distance(out, expected)
    assert torch.equal(out, expected), (f"{name}: {(ulps == 0).float().mean().item():.6f} bit-equal to the torch "
                                        f"path, at most {ulps.max().item()} ulps apart")


def _check_rotary(out: torch.Tensor, expected: torch.Tensor, x: torch.Tensor) -> float:
    """Asserts ``out`` within one ulp of the dtype at each pair's scale and >= 99% bit-equal to
    ``expected``; returns the bit-equal fraction."""
    err = (out.float() - expected.float()).abs() / pair_magnitude(x, HEAD_DIM).clamp_min(1e-30)
    assert err.max().item() <= eps(out.dtype), f"error {err.max().item():.3g} x (|x1| + |x2|)"
    exact = (ulp_distance(out, expected) == 0).float().mean().item()
    assert exact >= 0.99, f"only {exact:.4f} bit-equal"
    return exact


def _check_silu(out: torch.Tensor, expected: torch.Tensor) -> float:
    """Asserts ``out`` within two ulps (silu is rounded to the dtype before the product, so one
    ulp there can become two in the output) and >= 99% bit-equal; returns the bit-equal fraction."""
    ulps = ulp_distance(out, expected)
    assert ulps.max().item() <= 2, f"{ulps.max().item()} ulps"
    exact = (ulps == 0).float().mean().item()
    assert exact >= 0.99, f"only {exact:.4f} bit-equal"
    return exact


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_kernels_match_torch_path(tokens, dtype):
    rope = _rope()
    positions = torch.empty(tokens, dtype=torch.int64, device=DEVICE)
    qkv = torch.empty(tokens, QKV_WIDTH, dtype=dtype, device=DEVICE)
    x = torch.empty(tokens, 2 * INTERMEDIATE, dtype=dtype, device=DEVICE)
    _fill(positions, qkv, x, seed=tokens)
    q, k, v = _split(qkv)
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    v_before = v.clone()
    q_out, k_out = rotary_embedding(positions, q, k, rope.inv_freq)
    exact_q = _check_rotary(q_out, q_ref, q)
    exact_k = _check_rotary(k_out, k_ref, k)
    rotary_embedding(positions, q, k, rope.inv_freq, q_out=q, k_out=k)  # in place in the packed buffer
    assert torch.equal(q, q_out) and torch.equal(k, k_out) and torch.equal(v, v_before)
    exact_silu = _check_silu(silu_and_mul(x), SiluAndMul().forward_torch(x))
    print(f"\nT={tokens} {dtype}: bit-equal to torch: q {exact_q:.4f}, k {exact_k:.4f}, silu_and_mul {exact_silu:.4f}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_store_kv_matches_torch_path_bit_for_bit(tokens, dtype):
    rope = _rope()
    positions = torch.empty(tokens, dtype=torch.int64, device=DEVICE)
    qkv = torch.empty(tokens, QKV_WIDTH, dtype=dtype, device=DEVICE)
    _fill(positions, qkv, torch.empty(0, device=DEVICE), seed=tokens + 1)
    q, k, v = _split(qkv)
    k_cache, v_cache, slots = _kv_case(tokens, dtype, seed=tokens)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qkv_before = qkv.clone()
    q_ref = _rotary_store_kv_torch(rope, positions, q, k, v, slots, k_ref, v_ref)
    q_out = rotary_embedding_store_kv(positions, q, k, v, rope.inv_freq, slots, k_cache, v_cache)
    assert torch.equal(qkv, qkv_before), "inputs were written"
    _assert_bit_equal("q", q_out, q_ref)
    _assert_bit_equal("k_cache", k_cache, k_ref)
    _assert_bit_equal("v_cache", v_cache, v_ref)
    # again over the written caches, q rotated in place in the packed buffer
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(rope.forward_torch(positions, q, k)[1], v, k_ref, v_ref, slots.roll(1))
    rotary_embedding_store_kv(positions, q, k, v, rope.inv_freq, slots.roll(1), k_cache, v_cache, q_out=q)
    _assert_bit_equal("q in place", q, q_ref)
    _assert_bit_equal("k_cache", k_cache, k_ref)
    _assert_bit_equal("v_cache", v_cache, v_ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_store_kv_head_norm_matches_torch_path(tokens, dtype):
    rope, head_norm = _rope(), _head_norm(dtype, seed=tokens)
    positions = torch.empty(tokens, dtype=torch.int64, device=DEVICE)
    qkv = torch.empty(tokens, QKV_WIDTH, dtype=dtype, device=DEVICE)
    _fill(positions, qkv, torch.empty(0, device=DEVICE), seed=tokens + 2)
    q, k, v = _split(qkv)
    k_cache, v_cache, slots = _kv_case(tokens, dtype, seed=tokens + 1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qkv_before, k_before = qkv.clone(), k_cache.clone()
    q_ref, q_normed, k_normed = _norm_rotary_store_kv_torch(rope, positions, q, k, v, slots, k_ref, v_ref, head_norm)
    q_out = rotary_embedding_store_kv(positions, q, k, v, rope.inv_freq, slots, k_cache, v_cache, head_norm=head_norm)
    assert torch.equal(qkv, qkv_before), "inputs were written"
    _assert_bit_equal("v_cache", v_cache, v_ref)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], k_before[untouched]), "a slot not in slot_mapping was written"
    assert_within_tolerance("q", q_out, q_ref, q_normed, HEAD_DIM)
    assert_within_tolerance("k", k_cache[slots].view(tokens, -1), k_ref[slots].view(tokens, -1), k_normed, HEAD_DIM)
    # batch invariance: the first token alone gets the same bits, into a cache slot of its own
    k_one, v_one = k_before.clone(), v_cache.clone()
    q_one = rotary_embedding_store_kv(positions[:1], q[:1], k[:1], v[:1], rope.inv_freq, slots[:1], k_one, v_one,
                                      head_norm=head_norm)
    assert torch.equal(q_one, q_out[:1]) and torch.equal(k_one[slots[:1]], k_cache[slots[:1]]), "T=1 differs"


def test_layers_dispatch_to_the_kernels_on_cuda(monkeypatch):
    calls = []

    def counted(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(layers.kernels.triton_rotary, "rotary_embedding", counted(rotary_embedding))
    monkeypatch.setattr(layers.kernels.triton_activation, "silu_and_mul", counted(silu_and_mul))
    monkeypatch.setattr(layers.kernels.triton_rotary, "rotary_embedding_store_kv", counted(rotary_embedding_store_kv))

    def no_torch_path(*args):
        raise AssertionError("the torch cache write or head norm ran on CUDA")

    monkeypatch.setattr(layers.rotary_embedding, "store_kv", no_torch_path)
    monkeypatch.setattr(layers.rotary_embedding, "rms_norm_heads", no_torch_path)
    positions = torch.arange(3, device=DEVICE)
    q, k, v = _split(torch.randn(3, QKV_WIDTH, device=DEVICE, dtype=torch.bfloat16))
    _rope()(positions, q, k)
    SiluAndMul()(torch.randn(3, 2 * INTERMEDIATE, device=DEVICE, dtype=torch.bfloat16))
    k_cache, v_cache, slots = _kv_case(3, torch.bfloat16, seed=0)
    _rope().forward_store_kv(positions, q, k, v, slots, k_cache, v_cache)
    _rope().forward_store_kv(positions, q, k, v, slots, k_cache, v_cache, _head_norm(torch.bfloat16, seed=0))
    assert calls == ["rotary_embedding", "silu_and_mul", "rotary_embedding_store_kv", "rotary_embedding_store_kv"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_cuda_graph_replay(tokens):
    """Both ops through the layers' forward (the dispatch the model runs), captured once; each
    replay with new positions and inputs equals the eager kernels bit for bit and the torch path."""
    dtype = torch.bfloat16
    rope, act = _rope(), SiluAndMul()
    positions = torch.empty(tokens, dtype=torch.int64, device=DEVICE)
    qkv = torch.empty(tokens, QKV_WIDTH, dtype=dtype, device=DEVICE)
    x = torch.empty(tokens, 2 * INTERMEDIATE, dtype=dtype, device=DEVICE)
    _fill(positions, qkv, x, seed=0)
    q, k, _ = _split(qkv)

    def step():
        return (*rope(positions, q, k), act(x))

    graph, outs = capture_cuda_graph(step)
    for seed in (1, 2, 3):
        _fill(positions, qkv, x, seed)
        for out in outs:
            out.fill_(float("nan"))  # every element must be written by the replay
        graph.replay()
        eager = step()
        for out, ref in zip(outs, eager):
            assert torch.equal(out, ref), "replay differs from the eager call"
        q_ref, k_ref = rope.forward_torch(positions, q, k)
        _check_rotary(outs[0], q_ref, q)
        _check_rotary(outs[1], k_ref, k)
        _check_silu(outs[2], act.forward_torch(x))


def _static_kv_case(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The static operands of a captured rotary + KV-store call, filled with seed 0:
    ``(positions, qkv, q, k, v, k_cache, v_cache, slots)`` (q, k, v views of qkv)."""
    positions = torch.empty(tokens, dtype=torch.int64, device=DEVICE)
    qkv = torch.empty(tokens, QKV_WIDTH, dtype=dtype, device=DEVICE)
    _fill(positions, qkv, torch.empty(0, device=DEVICE), seed=0)
    return (positions, qkv, *_split(qkv), *_kv_case(tokens, dtype, seed=0))


def _refill_kv_case(positions: torch.Tensor, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, seed: int) -> None:
    """New values, in place, for `_static_kv_case`'s operands (a replay's inputs)."""
    _fill(positions, qkv, torch.empty(0, device=DEVICE), seed)
    _fill_kv(k_cache, v_cache, slots, seed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_rotary_store_kv_cuda_graph_replay(tokens):
    """`forward_store_kv` (the layer's dispatch) captured once; each replay with new positions,
    qkv, caches and slots writes what the torch path writes, bit for bit."""
    rope = _rope()
    positions, qkv, q, k, v, k_cache, v_cache, slots = _static_kv_case(tokens, torch.bfloat16)

    def step() -> torch.Tensor:
        return rope.forward_store_kv(positions, q, k, v, slots, k_cache, v_cache)

    graph, q_out = capture_cuda_graph(step)
    for seed in (1, 2, 3):
        _refill_kv_case(positions, qkv, k_cache, v_cache, slots, seed)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        q_ref = _rotary_store_kv_torch(rope, positions, q, k, v, slots, k_ref, v_ref)
        q_out.fill_(float("nan"))  # every element must be written by the replay
        graph.replay()
        _assert_bit_equal("q", q_out, q_ref)
        _assert_bit_equal("k_cache", k_cache, k_ref)
        _assert_bit_equal("v_cache", v_cache, v_ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_rotary_store_kv_head_norm_cuda_graph_replay(tokens):
    """`forward_store_kv` with a HeadNorm (fp32 weights) captured once; each replay with new
    positions, qkv, caches, slots and norm weights writes what the eager kernel writes, bit for bit."""
    rope, head_norm = _rope(), _head_norm(torch.float32, seed=0)
    positions, qkv, q, k, v, k_cache, v_cache, slots = _static_kv_case(tokens, torch.bfloat16)

    def step() -> torch.Tensor:
        return rope.forward_store_kv(positions, q, k, v, slots, k_cache, v_cache, head_norm)

    graph, q_out = capture_cuda_graph(step)
    for seed in (1, 2, 3):
        _refill_kv_case(positions, qkv, k_cache, v_cache, slots, seed)
        for weight, new in zip(head_norm[:2], _head_norm(torch.float32, seed)[:2]):
            weight.copy_(new)
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        q_eager = rotary_embedding_store_kv(positions, q, k, v, rope.inv_freq, slots, k_eager, v_eager,
                                            head_norm=head_norm)
        q_out.fill_(float("nan"))  # every element must be written by the replay
        graph.replay()
        _assert_bit_equal("q", q_out, q_eager)
        _assert_bit_equal("k_cache", k_cache, k_eager)
        _assert_bit_equal("v_cache", v_cache, v_eager)


def _us_per_call(make_inputs: Callable[[], tuple], fn: Callable, input_bytes: int, calls_per_graph: int = 32,
                 repeats: int = 10) -> float:
    """Microseconds per ``fn(*inputs)``: one CUDA graph of ``calls_per_graph`` calls, cycling over
    enough input sets to exceed the L2 cache (256 MiB together, at most one per call), replayed
    ``repeats`` times, each timed with CUDA events; the median / calls_per_graph."""
    num_sets = max(1, min(calls_per_graph, -(-256 * 2**20 // input_bytes)))
    sets = [make_inputs() for _ in range(num_sets)]

    def calls() -> None:
        for i in range(calls_per_graph):
            fn(*sets[i % num_sets])

    return median_us_per_call(calls, calls_per_graph, warmup=1, trials=repeats)


@pytest.mark.timeout(300)
def test_print_timing_table():
    """µs per call (median over replays of a 32-call CUDA graph) and bytes moved per µs, Triton
    kernel against the torch path, bf16; the kernel must be faster at every size."""
    dtype = torch.bfloat16
    rope = _rope()

    def rotary_inputs(tokens: int) -> Callable[[], tuple]:
        def make() -> tuple:
            q, k, _ = _split(torch.randn(tokens, QKV_WIDTH, dtype=dtype, device=DEVICE))
            return torch.randint(0, 2**17, (tokens,), device=DEVICE), q, k
        return make

    def silu_inputs(tokens: int) -> Callable[[], tuple]:
        return lambda: (torch.randn(tokens, 2 * INTERMEDIATE, dtype=dtype, device=DEVICE),)

    def store_kv_inputs(tokens: int) -> Callable[[], tuple]:
        def make() -> tuple:
            positions, q, k = rotary_inputs(tokens)()
            v = torch.randn(k.shape, dtype=dtype, device=DEVICE)
            return (positions, q, k, v, torch.randperm(tokens, device=DEVICE),
                    *(torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE) for _ in range(2)))
        return make

    def unfused_store_kv(positions, q, k, v, slots, k_cache, v_cache) -> None:
        """What the layer ran before the fused kernel: the rotary kernel, then two index_copy_."""
        store_kv(rotary_embedding(positions, q, k, rope.inv_freq)[1], v, k_cache, v_cache, slots)

    def torch_store_kv(positions, q, k, v, slots, k_cache, v_cache) -> None:
        _rotary_store_kv_torch(rope, positions, q, k, v, slots, k_cache, v_cache)

    head_norm = _head_norm(dtype, seed=0)

    def fused_norm_store_kv(positions, q, k, v, slots, k_cache, v_cache) -> None:
        rotary_embedding_store_kv(positions, q, k, v, rope.inv_freq, slots, k_cache, v_cache, head_norm=head_norm)

    def torch_norm_store_kv(positions, q, k, v, slots, k_cache, v_cache) -> None:
        _norm_rotary_store_kv_torch(rope, positions, q, k, v, slots, k_cache, v_cache, head_norm)

    lines = [f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} intermediate={INTERMEDIATE} bf16, {torch.cuda.get_device_name(0)}",
             f"{'op':>15} {'T':>5} {'triton us':>10} {'GB/s':>6} {'torch us':>9} {'speedup':>7}"]
    slower = []
    for tokens in TOKENS:
        rows = [
            ("rotary", rotary_inputs(tokens), lambda p, q, k: rotary_embedding(p, q, k, rope.inv_freq),
             rope.forward_torch, tokens * QKV_WIDTH * 2, 2 * tokens * (HEADS + KV_HEADS) * HEAD_DIM * 2),
            ("silu_and_mul", silu_inputs(tokens), silu_and_mul, SiluAndMul().forward_torch,
             tokens * 2 * INTERMEDIATE * 2, 3 * tokens * INTERMEDIATE * 2),
            ("rotary+kv", store_kv_inputs(tokens),
             lambda p, q, k, v, s, kc, vc: rotary_embedding_store_kv(p, q, k, v, rope.inv_freq, s, kc, vc),
             torch_store_kv, tokens * (QKV_WIDTH + 4 * KV_HEADS * HEAD_DIM) * 2,
             2 * tokens * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2),
            ("rotary,2 copies", store_kv_inputs(tokens), unfused_store_kv, torch_store_kv,
             tokens * (QKV_WIDTH + 4 * KV_HEADS * HEAD_DIM) * 2, 2 * tokens * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2),
            ("norm+rotary+kv", store_kv_inputs(tokens), fused_norm_store_kv, torch_norm_store_kv,
             tokens * (QKV_WIDTH + 4 * KV_HEADS * HEAD_DIM) * 2, 2 * tokens * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2),
        ]
        for name, make, kernel, reference, input_bytes, moved in rows:
            triton_us = _us_per_call(make, kernel, input_bytes)
            torch_us = _us_per_call(make, reference, input_bytes)
            lines.append(f"{name:>15} {tokens:>5} {triton_us:>10.2f} {moved / triton_us / 1e3:>6.0f} "
                         f"{torch_us:>9.2f} {torch_us / triton_us:>6.1f}x")
            if not 0 < triton_us < torch_us:
                slower.append(lines[-1])
    print("\n" + "\n".join(lines))
    assert not slower, f"not faster than the torch path: {slower}"
