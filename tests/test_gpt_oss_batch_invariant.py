"""Batch-invariant mode (``--deterministic``) of gpt-oss's Triton experts
(layers/moe/kernels/triton_mxfp4_moe.py, tiles from layers/moe/kernels/mxfp4_moe_config.py):
a token's expert output has the same bits whatever batch it is in.

- `experts_block_config` in this mode: never the matrix-vector launches, and at every slot count
  the default grouped tiles with `BATCH_INVARIANT_VARIANT` (the token rows the MMA's M side, the
  byte decoder, K steps of 128, no K splits), MXFP4 and bf16-form weights;
- under Triton's CPU interpreter (one spawned process), MXFP4 and bf16-form, fp32: the batches of
  1, 7 and 24 tokens (the first tokens of one set of 48) give every token the bits the batch of 48
  gives it, all at the batch of 48's tile (the interpreter's dot is numpy's matmul of the whole
  tile, whose order of sums follows the tile's shape: across tiles only the GPU can tell, see
  tests/gpu/test_gpt_oss_batch_invariant.py);
- compiled for sm90 without a GPU (tests/offline_triton.py): at gpt-oss-20b's shapes, 1 to 2048
  tokens, every dot of both grouped launches sums K steps of the same extent in k16 instructions,
  while the default mode's steps change with the batch.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from arfusion.layers import batch_invariant
from arfusion.layers.moe.kernels.mxfp4_moe_config import BATCH_INVARIANT_VARIANT, experts_block_config
from tests.dist_utils import run_under_triton_interpreter

EXPERTS, HIDDEN, INTER, TOP_K = 8, 64, 96, 4  # interpreter shapes: K loops of 128 with a ragged step
BATCHES, ALL = (1, 7, 24), 48
GPT_OSS_20B = (32, 2880, 2880, 4)  # (experts, hidden, expert intermediate, top_k)
COMPILED_TOKENS = (1, 7, 64, 512, 2048)


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("num_slots", [1, 8, 32, 33, 256, 257, 1024, 1025, 8192, 200_000])
def test_batch_invariant_tiles_pin_the_k_chunks(mxfp4, num_slots):
    default = experts_block_config(num_slots, 32, mxfp4)
    fixed = experts_block_config(num_slots, 32, mxfp4, deterministic=True)
    assert not fixed.gemv
    assert {name: getattr(fixed, name) for name in BATCH_INVARIANT_VARIANT} == BATCH_INVARIANT_VARIANT
    if not default.gemv:  # what still follows the rows: the M/N tiles, warps and stages
        assert fixed == dataclasses.replace(default, **BATCH_INVARIANT_VARIANT)


def test_the_default_mode_changes_its_k_chunks_with_the_batch():
    small, large = experts_block_config(4, 32), experts_block_config(4096, 32)
    assert small.gemv and large.swap and large.word_decode and large.block_k_gate_up != 128


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton
    from tests.test_gpt_oss_moe_triton import fill_experts

    g = torch.Generator().manual_seed(3)
    x = torch.randn(ALL, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(ALL)]).to(torch.int32)
    weights = torch.softmax(torch.randn(ALL, TOP_K, generator=g), dim=-1)
    results = {}
    with batch_invariant.batch_invariant_mode(True):
        config = experts_block_config(ALL * TOP_K, EXPERTS, deterministic=True)  # one tile: module docstring
        for mxfp4 in (True, False):
            experts = GptOssExperts(EXPERTS, HIDDEN, INTER, 1.702, 7.0, mxfp4, torch.float32, None)
            fill_experts(experts, 1)
            for tokens in (*BATCHES, ALL):
                results[mxfp4, tokens] = gpt_oss_experts_triton(x[:tokens], experts, weights[:tokens], ids[:tokens],
                                                                config)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("tokens", BATCHES)
@pytest.mark.parametrize("mxfp4", [True, False])
def test_triton_experts_are_row_invariant(interpreted, mxfp4, tokens):
    out = interpreted[mxfp4, tokens]
    assert out.shape == (tokens, HIDDEN)
    assert torch.equal(out, interpreted[mxfp4, ALL][:tokens])


# --- compiled for sm90, no GPU needed --------------------------------------------------------

@pytest.fixture(scope="module")
def offline():
    pytest.importorskip("triton")
    offline_triton = pytest.importorskip("tests.offline_triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    return offline_triton


def _stand_in_experts(mxfp4: bool) -> SimpleNamespace:
    """What the grouped launches read of a `GptOssExperts` at gpt-oss-20b's TP1 shapes, as empty
    CPU tensors (never read: nothing runs; no TP group needed)."""
    e, h, i, _ = GPT_OSS_20B
    parts = dict(hidden_size=h, local=i, num_experts=e, mxfp4=mxfp4, alpha=1.702, limit=7.0, tp_rank=0,
                 w13_bias=torch.empty(e, 2 * i, dtype=torch.bfloat16), w2_bias=torch.empty(e, h, dtype=torch.bfloat16))
    if mxfp4:
        parts.update(w13_blocks=torch.empty(e, 2 * i, h // 32, 16, dtype=torch.uint8),
                     w13_scales=torch.empty(e, 2 * i, h // 32, dtype=torch.uint8),
                     w2_blocks=torch.empty(e, h, i // 32, 16, dtype=torch.uint8),
                     w2_scales=torch.empty(e, h, i // 32, dtype=torch.uint8))
    else:
        parts.update(w13_weight=torch.empty(e, 2 * i, h, dtype=torch.bfloat16),
                     w2_weight=torch.empty(e, h, i, dtype=torch.bfloat16))
    return SimpleNamespace(**parts)


def _expert_launches(offline, monkeypatch, tokens: int, on: bool, mxfp4: bool) -> list:
    from arfusion.layers.moe.kernels import triton_mxfp4_moe

    experts_count, hidden, inter, top_k = GPT_OSS_20B
    kernels = {name: offline.RecordedKernel(getattr(triton_mxfp4_moe, name)) for name in ("_gate_up_kernel",
                                                                                         "_down_kernel")}
    for name, recorder in kernels.items():
        monkeypatch.setattr(triton_mxfp4_moe, name, recorder)
    monkeypatch.setattr(triton_mxfp4_moe.triton.knobs.runtime, "interpret", False)
    experts = _stand_in_experts(mxfp4)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts_count, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    with batch_invariant.batch_invariant_mode(on):
        config = experts_block_config(tokens * top_k, experts_count, mxfp4, deterministic=on)
        if config.gemv:
            return []
        blocks = triton_mxfp4_moe.align_by_expert(ids, experts_count, config.block_m)
        triton_mxfp4_moe._grouped_partials(torch.empty(tokens, hidden, dtype=torch.bfloat16), experts, ids, blocks,
                                           config)
    return [(recorder.fn, *call) for recorder in kernels.values() for call in recorder.calls]


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("tokens", COMPILED_TOKENS)
def test_sm90_batch_invariant_dots_take_the_same_k_chunks_at_every_batch(offline, monkeypatch, tokens, mxfp4):
    launches = _expert_launches(offline, monkeypatch, tokens, True, mxfp4)
    assert len(launches) == 2
    for fn, args, kwargs in launches:
        asm = offline.compiled_asm(fn, args, kwargs)
        extents = set(offline.dot_k_extents(asm["ttgir"]))
        # the byte decoder's two dots take a K step's even and odd columns: 64 of its 128 each
        assert extents == ({64} if mxfp4 else {128}), (fn.__name__, extents)
        assert offline.ptx_mma_k(asm["ptx"]) == {16}, fn.__name__


def test_sm90_default_k_steps_follow_the_rows(offline, monkeypatch):
    steps = {}
    for tokens in (64, 2048):
        with monkeypatch.context() as patch:
            steps[tokens] = {fn.__name__: set(offline.dot_k_extents(offline.ttgir(fn, args, kwargs)))
                             for fn, args, kwargs in _expert_launches(offline, patch, tokens, False, True)}
    assert steps[64] != steps[2048], steps
