"""Batch-invariant mode (``--deterministic``) of the Qwen3-MoE / Mixtral MoE path (layers/moe/):
a token's routing and expert output have the same bits whatever batch it is in.

Inputs: 128 random tokens (hidden 256), a random gate of 8 experts, top-2 renormalised, random
experts of intermediate 96 (so the K loops take 2 steps of 128 and 2 of 64, the last ragged);
the batches of 1, 7, 64 and 128 tokens are the first tokens of that set, so each token meets
other tokens, and other rows per expert, in each batch. Checked bit for bit against the batch
of 128:

- the Triton routing and fused MoE (layers/moe/kernels/) under Triton's CPU interpreter
  (TRITON_INTERPRET=1, one spawned process), bf16 and fp32, folded and unfused combine: the
  routing's weights and ids, and the expert output, every batch at the batch of 128's
  batch-invariant tile (32 rows, the pinned K steps). Not across tiles: the interpreter has no
  tensor-core instructions, its dot is numpy's fp32 matmul of the whole tile, whose order of sums
  follows the tile's shape (16- against 32-row tiles differ in fp32 there), so neither wgmma nor
  mma.sync nor the tile switch can be checked on the CPU: the GPU test checks those bits;
- the torch path (CPU): `router_logits_torch` + `select_experts` + `moe_experts_torch`, fp32 and
  bf16 (torch's CPU matmul alone changes a row's bits between 1-3 rows and more, see
  tests/test_batch_invariant_ops.py);
- `block_config` in batch-invariant mode: the default's tiles with only the K steps pinned;
- compiled for sm90 without a GPU (tests/offline_triton.py; skipped where triton's NVIDIA
  backend cannot compile): at 1 to 2048 tokens of Qwen3-30B-A3B's shapes every dot of both expert
  launches in batch-invariant mode takes K steps of the pinned size (128 gate/up, 64 down) and its
  PTX sums them in k16 instructions, while the instruction family changes from mma.sync (1 token)
  to wgmma (2048 tokens): that the two round alike is measured on the GPU only. The default
  tiles' K steps change with the batch (why the default mode is not invariant); and the routing's
  two sums (softmax denominator, renormalisation) reduce tiles of one layout at 1 to 512 tokens,
  on the one-launch path (its default at 1 token, and asked for up to 2048 slots) and the two-launch path, at Qwen3-30B-A3B's and Mixtral's
  routers and gpt-oss-120b's (with its bias). The GPU itself is checked by tests/gpu/test_moe_batch_invariant.py.
"""
import dataclasses

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
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config, fused_moe
    from arfusion.layers.moe.kernels.triton_router import route_triton

    results = {}
    with batch_invariant.batch_invariant_mode(True):
        config = block_config(ALL * TOP_K, EXPERTS)  # one tile for every batch: see the module docstring
        for dtype_name, dtype in DTYPES.items():
            h, gate, w13, w2 = make_inputs(dtype)
            for tokens in (*BATCHES, ALL):
                counter = torch.zeros(1, dtype=torch.int32)
                weights, ids, blocks = route_triton(h[:tokens], gate, TOP_K, True, counter, config.block_m)
                results["routing", dtype_name, tokens] = (weights, ids)
                for combine in COMBINES:
                    results[dtype_name, combine, tokens] = fused_moe(h[:tokens], w13, w2, weights, ids, combine, config,
                                                                     blocks=blocks if combine == "folded" else None)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


def test_the_rows_change_the_tiles_but_not_the_k_steps():
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config, default_block_config

    with batch_invariant.batch_invariant_mode(True):
        configs = [block_config(t * TOP_K, EXPERTS) for t in (*BATCHES, ALL)]
    assert [c.block_m for c in configs] == [16, 16, 16, 32]  # the batches cross a tile switch
    assert {(c.block_k_gate_up, c.block_k_down) for c in configs} == {(128, 64)}
    assert default_block_config(ALL * TOP_K, EXPERTS).block_k_gate_up != 128  # the default's K step changes


@pytest.mark.parametrize("num_slots", [1, 16 * 128, 16 * 128 + 1, 64 * 128, 64 * 128 + 1, 200_000])
def test_batch_invariant_tiles_are_the_defaults_with_pinned_k_steps(num_slots):
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config, default_block_config

    default = default_block_config(num_slots, 128)
    with batch_invariant.batch_invariant_mode(True):
        fixed = block_config(num_slots, 128)
    assert fixed == dataclasses.replace(default, block_k_gate_up=128, block_k_down=64)
    assert block_config(num_slots, 128) == default  # the default mode keeps its tiles


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
PINNED_K = {"_gate_up_silu_kernel": 128, "_down_kernel": 64}  # BATCH_INVARIANT_BLOCK_K per launch


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


@pytest.mark.parametrize("tokens", (*COMPILED_TOKENS, 2048))
def test_sm90_batch_invariant_dots_take_the_same_k_chunks_at_every_batch(offline, monkeypatch, tokens):
    launches = _expert_launches(offline, monkeypatch, tokens, on=True)
    assert len(launches) == 2
    for fn, args, kwargs in launches:
        asm = offline.compiled_asm(fn, args, kwargs)
        extents = offline.dot_k_extents(asm["ttgir"])
        assert extents and set(extents) == {PINNED_K[fn.__name__]}, (fn.__name__, extents)
        assert offline.ptx_mma_k(asm["ptx"]) == {16}, fn.__name__


def test_sm90_batch_invariant_tiles_cross_the_instruction_switch(offline, monkeypatch):
    """1 token runs mma.sync, 2048 tokens (64-row tiles) wgmma: the GPU test's comparisons of
    1 to 512 tokens against 2048 check that the two round alike."""
    for tokens, version in ((1, 2), (2048, 3)):
        with monkeypatch.context() as patch:  # the kernels unpatched between the two
            launches = _expert_launches(offline, patch, tokens, on=True)
        for launch in launches:
            assert set(offline.mma_versions(offline.ttgir(*launch))) == {version}, (tokens, launch[0].__name__)


def test_sm90_default_k_steps_follow_the_rows(offline, monkeypatch):
    steps = {}
    for tokens in (1, 2048):
        with monkeypatch.context() as patch:
            steps[tokens] = {fn.__name__: set(offline.dot_k_extents(offline.ttgir(fn, args, kwargs)))
                             for fn, args, kwargs in _expert_launches(offline, patch, tokens, on=False)}
    assert steps[1]["_gate_up_silu_kernel"] == {128} and steps[2048]["_gate_up_silu_kernel"] == {64}


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
    for tokens in COMPILED_TOKENS:
        h = torch.randn(tokens, hidden, generator=g).bfloat16()
        paths = (None, True, False) if tokens * top_k <= triton_router.FUSED_MAX_SLOTS else (None,)
        for one_launch in paths:
            triton_router.route_triton(h, gate, top_k, True, torch.zeros(1, dtype=torch.int32), 16, bias,
                                       one_launch=one_launch)
    layouts: dict[tuple[str, ...], set[str]] = {}
    for kernel in kernels:
        for args, kwargs in kernel.calls:
            sums = tuple(offline.add_reduction_layouts(offline.ttgir(kernel.fn, args, kwargs)))
            if sums:  # the two-launch path's first launch selects nothing
                layouts.setdefault(sums, set()).add(kernel.fn.__name__)
    assert list(layouts.values()) == [{"_route_kernel", "_select_kernel"}], layouts
    assert len(next(iter(layouts))) == 2  # the softmax's denominator and the renormalisation
