"""gpt-oss's MXFP4 experts on tensor cores (layers/moe/kernels/gluon_mxfp4_experts.py,
`Mxfp4MoEConfig.tensor_cores`) on one GPU, bf16 activations, gpt-oss-20b's expert shapes at TP1
(intermediate 2880, K steps of 64) and TP2 (1440 a rank, the down launch's K steps of 32), with
an intermediate size of 3072 (the down launch's K steps of 128), and with K steps of 256 and 512
(at 2880 five steps of 512, then steps of 256 and 64; at TP2's 1440 two, then 256, 128 and 32;
at TP4's 736 one, then 128, 64 and 32), 8 of
its 32 experts (so that blocks hold several rows), top-4, MXFP4 scales / 16 of `fill_experts`'
(activations of order one, as in the model):

- against `GptOssExperts.forward_torch` on the same weights at 1 / 3 / 8 / 33 / 64 tokens:
  relative RMS error at most 1e-2 (the bound of tests/gpu/test_mxfp4_moe_variants.py: the same
  bf16 weights and roundings, fp32 sums in another order);
- two eager calls give the same bits; a token's output has the same bits alone as in a batch of
  64 (a row's sums do not depend on its block mates); a CUDA graph captured at 8 tokens and
  replayed with new routing and activations gives the eager bits;
- a scale above 2^1 is refused with a ValueError naming it;
- with `Mxfp4MoEConfig.prefetch` (each K step loaded one step ahead) all of the above, and the
  bits of the same tiles without it.

Printed with ``-s``: µs per call (CUDA graph of 20 calls) of the default configuration and of
these launches at 1, 2, 4, 8, 16 and 32 tokens, gpt-oss-20b's 32 experts.
"""
import dataclasses

import pytest
import torch

from tests.dist_utils import run_distributed

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpus(1), pytest.mark.timeout(600)]

TILES = dict(block_m=8, block_n_gate_up=64, block_k_gate_up=64, block_n_down=64, block_k_down=64, num_warps=4,
             tensor_cores=True)
SHAPES = {"tp1": (2880, TILES), "tp2": (1440, dict(TILES, block_n_down=32, block_k_down=32, num_warps_down=2)),
          "k128": (3072, dict(TILES, block_n_down=128, block_k_down=128)),
          "tp1-prefetch": (2880, dict(TILES, prefetch=True)),
          "tp2-prefetch": (1440, dict(TILES, block_n_down=32, block_k_down=32, num_warps_down=2, prefetch=True)),
          "k128-prefetch": (3072, dict(TILES, block_n_down=128, block_k_down=128, prefetch=True)),
          "k512": (2880, dict(TILES, block_k_gate_up=512, block_k_down=512)),
          "k512-tp2": (1440, dict(TILES, block_k_gate_up=512, block_k_down=512, block_n_down=32, num_warps_down=2)),
          "k512-tp4": (736, dict(TILES, block_k_gate_up=512, block_k_down=512, block_n_gate_up=32, num_warps=2)),
          "k256-prefetch": (2880, dict(TILES, block_k_gate_up=256, block_k_down=256, prefetch=True))}
TOKENS = (1, 3, 8, 33, 64)
TIMED_TOKENS = (1, 2, 4, 8, 16, 32)


def _experts(num_experts: int, inter: int):
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from tests.test_gpt_oss_moe_triton import fill_experts

    experts = GptOssExperts(num_experts, 2880, inter, 1.702, 7.0, True, torch.bfloat16, None)
    fill_experts(experts, 7)
    with torch.no_grad():
        experts.w13_scales.sub_(4)
        experts.w2_scales.sub_(4)
    return experts.cuda()


def _shape_rank(rank: int, world: int, shape: str) -> dict:
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import Mxfp4MoEConfig, gpt_oss_experts_triton
    from tests.gpu.test_mxfp4_moe_variants import config_results

    inter, tiles = SHAPES[shape]
    config = Mxfp4MoEConfig(**tiles)
    experts = _experts(8, inter)
    with torch.no_grad():
        out = config_results(experts, config, TOKENS)
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, 2880, generator=g).to(torch.bfloat16).cuda()
        ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(64)]).to(torch.int32).cuda()
        weights = torch.softmax(torch.randn(64, 4, generator=g), -1).cuda()
        batch = gpt_oss_experts_triton(x, experts, weights, ids, config)
        out["alone"] = all(torch.equal(gpt_oss_experts_triton(x[t:t + 1], experts, weights[t:t + 1], ids[t:t + 1],
                                                              config), batch[t:t + 1]) for t in (0, 17, 63))
        without = gpt_oss_experts_triton(x, experts, weights, ids, dataclasses.replace(config, prefetch=False))
        out["as_without_prefetch"] = torch.equal(batch, without)
        big = _experts(8, inter)
        big.w2_scales[1, 2, 3] = 129
        try:
            gpt_oss_experts_triton(x, big, weights, ids, config)
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_tensor_core_launches_match_the_reference(shape):
    r = run_distributed(_shape_rank, world_size=1, args=(shape,), device_kind="cuda", timeout_s=500)[0]
    print(f"\ntensor cores {shape}: relative RMS error by tokens {r['error']}")
    assert all(r["error"][t] <= 1e-2 for t in TOKENS), r
    assert all(r["deterministic"].values()), r
    assert r["alone"], "a token alone has the bits it has in the batch"
    assert r["graph"], "a CUDA-graph replay with new routing gives the eager result"
    assert r["as_without_prefetch"], "loading K steps ahead changes no bit"
    assert r["refused"] is not None and "2^2 exceeds" in r["refused"], r["refused"]


def _timing_rank(rank: int, world: int) -> list[str]:
    from arfusion.fusion.tuning.timing import median_us_per_call
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import Mxfp4MoEConfig, gpt_oss_experts_triton

    experts = _experts(32, 2880)
    config = Mxfp4MoEConfig(**TILES)
    g = torch.Generator().manual_seed(5)
    lines = []
    with torch.no_grad():
        for tokens in TIMED_TOKENS:
            x = torch.randn(tokens, 2880, generator=g).to(torch.bfloat16).cuda()
            ids = torch.stack([torch.randperm(32, generator=g)[:4] for _ in range(tokens)]).to(torch.int32).cuda()
            weights = torch.full((tokens, 4), 0.25, device="cuda")
            us = {}
            for name, cfg in (("default", None), ("tensor cores", config)):
                us[name] = median_us_per_call(lambda: [gpt_oss_experts_triton(x, experts, weights, ids, cfg)
                                                       for _ in range(20)], 20)
            lines.append(f"T={tokens:3d}  default {us['default']:7.1f} us  tensor cores {us['tensor cores']:7.1f} us  "
                         f"({us['tensor cores'] / us['default']:.2f}x)")
    return lines


def test_timing_table():
    lines = run_distributed(_timing_rank, world_size=1, device_kind="cuda", timeout_s=500)[0]
    print("\n" + "\n".join(lines))
