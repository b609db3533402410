"""Batch-invariant mode (``--deterministic``) of the Qwen3-MoE / Mixtral MoE path (layers/moe/):
a token's routing and expert output have the same bits whatever batch it is in.

Inputs: 128 random tokens (hidden 256), a random gate of 8 experts, top-2 renormalised, random
experts of intermediate 96 (so the K loops take 2 steps of 128 and 2 of 64, the last ragged);
the batches of 1, 7, 64 and 128 tokens are the first tokens of that set, so each token meets
other tokens, and other rows per expert, in each batch. Checked bit for bit against the batch
of 128:

- the Triton routing and fused MoE (layers/moe/kernels/) under Triton's CPU interpreter
  (TRITON_INTERPRET=1, one spawned process), bf16 and fp32, folded and unfused combine: the
  routing's weights and ids, and the expert output. At 128 tokens the default tiles would be
  taller (32 rows per expert), the batch-invariant ones are not;
- the torch path (CPU): `router_logits_torch` + `select_experts` + `moe_experts_torch`, fp32 and
  bf16 (torch's CPU matmul alone changes a row's bits between 1-3 rows and more, see
  tests/test_batch_invariant_ops.py);
- compiled for sm90 without a GPU (tests/offline_triton.py; skipped where triton's NVIDIA
  backend cannot compile): the batch-invariant tiles give every dot of both expert launches the
  mma.sync instruction at 1 to 512 tokens of Qwen3-30B-A3B's shapes, where the default tiles give
  wgmma at 2048 tokens (64-row blocks: why the default mode is not invariant); and the routing's
  two sums (softmax denominator, renormalisation) reduce tiles of one layout at 1 to 512 tokens,
  on the one-launch path (up to 256) and the two-launch path, at Qwen3-30B-A3B's and Mixtral's
  routers and gpt-oss-120b's (with its bias). The GPU itself is checked by tests/gpu/test_moe_batch_invariant.py.
"""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers import batch_invariant  # noqa: E402
from arfusion.layers.moe.router import router_logits_torch, select_experts  # noqa: E402
from arfusion.layers.moe.torch_experts import moe_experts_torch  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 8, 256, 96, 2
BATCHES = (1, 7, 64)
ALL = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMBINES = ("folded", "unfused")


def make_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(h [ALL, H], gate [E, H], w13 [E, 2I, H], w2 [E, H, I])`` in ``dtype``, seeded."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(ALL, HIDDEN, generator=g)
    gate = torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN ** 0.5
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5
    return tuple(t.to(dtype) for t in (h, gate, w13, w2))


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config, default_block_config, fused_moe
    from arfusion.layers.moe.kernels.triton_router import route_triton

    results = {"default_block_m": default_block_config(ALL * TOP_K, EXPERTS).block_m}
    with batch_invariant.batch_invariant_mode(True):
        for dtype_name, dtype in DTYPES.items():
            h, gate, w13, w2 = make_inputs(dtype)
            for tokens in (*BATCHES, ALL):
                counter = torch.zeros(1, dtype=torch.int32)
                block_m = block_config(tokens * TOP_K, EXPERTS).block_m
                weights, ids, blocks = route_triton(h[:tokens], gate, TOP_K, True, counter, block_m)
                results["block_m", tokens] = block_m
                results["routing", dtype_name, tokens] = (weights, ids)
                for combine in COMBINES:
                    results[dtype_name, combine, tokens] = fused_moe(h[:tokens], w13, w2, weights, ids, combine,
                                                                     blocks=blocks if combine == "folded" else None)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


def test_the_tiles_do_not_follow_the_rows(interpreted):
    assert {interpreted["block_m", t] for t in (*BATCHES, ALL)} == {16}
    assert interpreted["default_block_m"] != 16  # so the batch of 128 would take other tiles by default


@pytest.mark.parametrize("tokens", BATCHES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_triton_routing_is_row_invariant(interpreted, dtype_name, tokens):
    weights, ids = interpreted["routing", dtype_name, tokens]
    all_weights, all_ids = interpreted["routing", dtype_name, ALL]
    assert torch.equal(ids, all_ids[:tokens])
    assert torch.equal(weights, all_weights[:tokens])


@pytest.mark.parametrize("tokens", BATCHES)
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_triton_experts_are_row_invariant(interpreted, dtype_name, combine, tokens):
    out = interpreted[dtype_name, combine, tokens]
    assert out.shape == (tokens, HIDDEN)
    assert torch.equal(out, interpreted[dtype_name, combine, ALL][:tokens])


def _torch_moe(h: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    weights, ids = select_experts(router_logits_torch(h, gate), TOP_K, renormalize=True)
    return weights, ids, moe_experts_torch(h, w13, w2, weights, ids)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_torch_path_is_row_invariant(dtype_name):
    h, gate, w13, w2 = make_inputs(DTYPES[dtype_name])
    with batch_invariant.batch_invariant_mode(True):
        everything = _torch_moe(h, gate, w13, w2)
        for tokens in BATCHES:
            for part, whole in zip(_torch_moe(h[:tokens], gate, w13, w2), everything):
                assert torch.equal(part, whole[:tokens]), tokens
    off = _torch_moe(h, gate, w13, w2)  # the mode changes only the order of sums: the same math
    for fixed, default in zip(everything, off):
        torch.testing.assert_close(fixed, default, rtol=2e-2, atol=2e-2)


# --- compiled for sm90, no GPU needed --------------------------------------------------------

QWEN3 = (128, 2048, 768, 8)  # (experts, hidden, expert intermediate, top_k) of Qwen3-30B-A3B
# (E, hidden, top_k, router bias); gpt-oss's router is the renormalised top-k with a bias
ROUTERS = {"qwen3-30b-a3b": (128, 2048, 8, False), "mixtral-8x7b": (8, 4096, 2, False),
           "gpt-oss-120b": (128, 2880, 4, True)}
COMPILED_TOKENS = (1, 7, 64, 128, 512)


@pytest.fixture(scope="module")
def offline():
    offline_triton = pytest.importorskip("tests.offline_triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    return offline_triton


def _expert_launches(offline, monkeypatch, tokens: int, on: bool) -> list:
    from arfusion.layers.moe.align import align_by_expert
    from arfusion.layers.moe.kernels import triton_fused_moe

    experts, hidden, inter, top_k = QWEN3
    kernels = {name: offline.RecordedKernel(getattr(triton_fused_moe, name))
               for name in ("_gate_up_silu_kernel", "_down_kernel")}
    for name, recorder in kernels.items():
        monkeypatch.setattr(triton_fused_moe, name, recorder)
    monkeypatch.setattr(triton_fused_moe.triton.knobs.runtime, "interpret", False)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16)  # never read: nothing runs
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16)
    with batch_invariant.batch_invariant_mode(on):
        block_m = triton_fused_moe.block_config(tokens * top_k, experts).block_m
        triton_fused_moe.fused_moe(x, w13, w2, torch.rand(tokens, top_k, generator=g), ids,
                                   blocks=align_by_expert(ids, experts, block_m))
    return [(recorder.fn, *call) for recorder in kernels.values() for call in recorder.calls]


@pytest.mark.parametrize("tokens", COMPILED_TOKENS)
def test_sm90_batch_invariant_tiles_use_mma_sync_at_every_batch(offline, monkeypatch, tokens):
    for fn, args, kwargs in _expert_launches(offline, monkeypatch, tokens, on=True):
        versions = offline.mma_versions(offline.ttgir(fn, args, kwargs))
        assert versions and set(versions) == {2}, (fn.__name__, versions)


def test_sm90_default_tiles_switch_to_wgmma(offline, monkeypatch):
    launches = _expert_launches(offline, monkeypatch, 2048, on=False)
    assert all(3 in offline.mma_versions(offline.ttgir(*launch)) for launch in launches)


@pytest.mark.parametrize("router", list(ROUTERS))
def test_sm90_routing_sums_have_one_layout_at_every_batch(offline, monkeypatch, router):
    from arfusion.layers.moe.kernels import triton_router

    experts, hidden, top_k, has_bias = ROUTERS[router]
    kernels = [offline.RecordedKernel(getattr(triton_router, name)) for name in ("_route_kernel", "_select_kernel")]
    for kernel in kernels:
        monkeypatch.setattr(triton_router, kernel.fn.__name__, kernel)
    monkeypatch.setattr(triton_router.triton.knobs.runtime, "interpret", False)
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(experts, hidden, generator=g).bfloat16()
    bias = torch.randn(experts, generator=g).bfloat16() if has_bias else None
    for tokens in (*COMPILED_TOKENS, triton_router.FUSED_MAX_TOKENS, triton_router.FUSED_MAX_TOKENS + 1):
        h = torch.randn(tokens, hidden, generator=g).bfloat16()
        triton_router.route_triton(h, gate, top_k, True, torch.zeros(1, dtype=torch.int32), 16, bias)
    layouts: dict[tuple[str, ...], set[str]] = {}
    for kernel in kernels:
        for args, kwargs in kernel.calls:
            sums = tuple(offline.add_reduction_layouts(offline.ttgir(kernel.fn, args, kwargs)))
            if sums:  # the two-launch path's first launch selects nothing
                layouts.setdefault(sums, set()).add(kernel.fn.__name__)
    assert list(layouts.values()) == [{"_route_kernel", "_select_kernel"}], layouts
    assert len(next(iter(layouts))) == 2  # the softmax's denominator and the renormalisation
