"""gpt-oss's routing groups the slots by expert for the experts' grouped launches, which then skip
their own grouping launch (`GptOssExperts.block_m`, `gpt_oss_experts_triton(..., blocks=...)`).

Under Triton's CPU interpreter (one spawned child; skipped without triton), fp32, 8 experts of
hidden 64 / intermediate 96, top-4, 1, 5 and 33 tokens (one and several blocks an expert; the
one-launch path, the default at 1 token and asked for beyond): the routing launch's blocks
(`route_triton` with the router's bias, ``block_m`` 8, 16 and 32) equal
`align_by_expert`'s, and the experts' grouped launches give the same bits with them as with
their own grouping; blocks of another ``block_m`` than the launches' are refused by name.
Without a GPU: `GptOssMoeBlock` asks its experts for the block size and hands the routing's
blocks to them, plain or with the norm left pending (stand-ins record the calls).
"""
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter
from tests.test_gpt_oss_moe_triton import fill_experts

pytest.importorskip("triton")

TOKENS = (1, 5, 33)
TILES = dict(block_m=16, block_n_gate_up=32, block_k_gate_up=64, block_n_down=32, block_k_down=32, num_warps=4,
             num_stages=1)


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.moe.align import align_by_expert
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import Mxfp4MoEConfig, gpt_oss_experts_triton
    from arfusion.layers.moe.kernels.triton_router import route_triton

    experts = GptOssExperts(8, 64, 96, 1.702, 7.0, True, torch.float32, None)
    fill_experts(experts, 4)
    g = torch.Generator().manual_seed(9)
    router, bias = torch.randn(8, 64, generator=g) / 8, torch.randn(8, generator=g) * 0.1
    results = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, 64, generator=g)
        same_blocks = True
        for block_m in (8, 32):  # the tensor-core launches' smallest blocks, and wider ones
            _, ids_m, blocks_m = route_triton(x, router, 4, True, torch.zeros(1, dtype=torch.int32), block_m, bias,
                                              one_launch=True)
            aligned = align_by_expert(ids_m, 8, block_m)
            same_blocks &= all(torch.equal(getattr(blocks_m, f), getattr(aligned, f))
                               for f in ("sorted_slots", "block_expert", "num_rows"))
        weights, ids, blocks = route_triton(x, router, 4, True, torch.zeros(1, dtype=torch.int32), 16, bias,
                                            one_launch=True)
        aligned = align_by_expert(ids, 8, 16)
        same_blocks &= all(torch.equal(getattr(blocks, f), getattr(aligned, f))
                           for f in ("sorted_slots", "block_expert", "num_rows"))
        cfg = Mxfp4MoEConfig(**TILES)
        routed = gpt_oss_experts_triton(x, experts, weights, ids, cfg, blocks=blocks)
        own = gpt_oss_experts_triton(x, experts, weights, ids, cfg)
        try:
            gpt_oss_experts_triton(x, experts, weights, ids, Mxfp4MoEConfig(**{**TILES, "block_m": 32}), blocks=blocks)
            refusal = None
        except ValueError as exc:
            refusal = str(exc)
        results[tokens] = (same_blocks, torch.equal(routed, own), refusal)
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted, timeout_s=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tokens", TOKENS)
def test_the_routings_blocks_serve_the_grouped_launches(interpreted, tokens):
    same_blocks, same_bits, refusal = interpreted[tokens]
    assert same_blocks and same_bits
    assert refusal == "the slots were grouped in blocks of 16 rows, the launches take 32"


def test_the_block_hands_the_routings_blocks_to_its_experts(monkeypatch):
    from arfusion.layers.moe.gpt_oss_moe import GptOssMoeBlock
    from arfusion.layers.pending_norm import PendingNorm

    monkeypatch.setattr("arfusion.layers.moe.gpt_oss_moe.get_tp_group", lambda: SimpleNamespace(rank=0, world_size=1))
    block = GptOssMoeBlock(64, 8, 4, 64, 1.702, 7.0, True, torch.float32, None)
    calls = []
    blocks = object()
    monkeypatch.setattr(block.experts, "block_m", lambda tokens, top_k: calls.append(("block_m", tokens, top_k)) or 16)
    monkeypatch.setattr(block.router, "route", lambda h, block_m: calls.append(("route", block_m)) or ("w", "ids", blocks))
    monkeypatch.setattr(block.router, "route_normed",
                        lambda pending, block_m: calls.append(("route_normed", block_m)) or ("h", "w", "ids", blocks))
    monkeypatch.setattr(block.experts, "forward", lambda *args: calls.append(("experts", args[-1] is blocks)) or "out")
    assert block(torch.zeros(3, 64)) == "out"
    x = torch.zeros(5, 64)
    assert block(PendingNorm(x, x.clone(), torch.ones(64), 1e-6, torch.empty_like(x))) == "out"
    assert calls == [("block_m", 3, 4), ("route", 16), ("experts", True),
                     ("block_m", 5, 4), ("route_normed", 16), ("experts", True)]
