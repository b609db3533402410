"""gpt-oss's experts in Triton (layers/moe/kernels/triton_mxfp4_moe.py), bf16-form and MXFP4
weights, against the torch reference (`GptOssExperts.forward_torch`) under Triton's CPU
interpreter, fp32 activations (the interpreter's bf16 dots multiply bit patterns; bf16 runs in
tests/gpu/test_gpt_oss_gpu.py and tests/gpu/test_mxfp4_moe_variants.py). One spawned child with
TRITON_INTERPRET=1; skipped without triton. Routing: random top-4 of 8 experts, some experts
without tokens, token counts across one and several row blocks; weights and biases seeded random,
gate/up spread to reach the SwiGLU's clamps. Every variant of `Mxfp4MoEConfig` (CONFIGS): the
default tiles at hidden = intermediate = 64 (one K-tile, masked columns; at 33 and 40 tokens, 16
and more rows per expert, the default is the weight as the left operand with the word decoder);
small tiles at hidden 96 (several K-tiles and column tiles, a masked K tail); the word decoder,
the weight as the left operand (swap) with token blocks of 8, 4 and 1 rows, and K splits of the
down projection (2 and 3, one of them empty) at 1 / 3 / 8 / 33 tokens, hidden and intermediate
96 or 160 (two K-tiles of 128, the second masked); the matrix-vector launches (gemv: MXFP4's default
at 5 tokens, and small tiles at 1 / 3 / 8 tokens over several K steps with a masked tail
and several row tiles with a masked last one). MXFP4 scales 2^-4 .. 2^-2, or 2^-9 .. 2^0
with some scale bytes 0 (2^-127).

TP2 shards (two spawned ranks over gloo, interpreter): each rank loads full MXFP4 checkpoint
tensors (gate/up interleaved) through `GptOssExperts.weight_loader` and runs the kernel on its
share; the two partial outputs summed equal the whole experts computed in fp32 from the full
tensors (even rows gate, odd rows up, the down bias once), at the same tolerance.

Tolerance: rtol = atol = 1e-4. The dequantized weights are exact, but the kernel sums each
fp32 dot in its own order (per K-tile and decoder piece: even and odd columns, or the eight
residues mod 8; per K split) where the reference sums the whole row: pre-activations of tens
differ by a few fp32 ulps, which the SwiGLU's slope (up to about 8) and the down projection
carry to the outputs (up to a few hundred here). Measured on the 2-core CPU (the largest
``|out - ref| / (atol + rtol * |ref|)`` of a case): at most 0.6 (wide scales at hidden 160),
0.33 or less without wide scales."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter

RTOL = ATOL = 1e-4
# the kernel's configurations (`Mxfp4MoEConfig` fields; None: the default tiles): every variant,
# token blocks of 16 .. 1 rows, K splits of the down projection that leave a split empty or not
CONFIGS = {
    "default": None,
    "small": dict(block_m=16, block_n_gate_up=16, block_k_gate_up=64, block_n_down=16, block_k_down=32, num_warps=4,
                  num_stages=1),
    "word": dict(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32, block_k_down=128,
                 word_decode=True),
    "swap": dict(block_m=4, block_n_gate_up=16, block_k_gate_up=64, block_n_down=32, block_k_down=32, swap=True,
                 split_k_down=2),
    "swap_word": dict(block_m=8, block_n_gate_up=32, block_k_gate_up=128, block_n_down=64, block_k_down=128,
                      swap=True, word_decode=True, split_k_down=3),
    "swap_word_m1": dict(block_m=1, block_n_gate_up=64, block_k_gate_up=128, block_n_down=64, block_k_down=128,
                         swap=True, word_decode=True, split_k_down=2),
    "gemv": dict(block_m=1, block_n_gate_up=16, block_k_gate_up=64, block_n_down=32, block_k_down=32, gemv=True),
}
# (tokens, mxfp4, hidden, intermediate, configuration, wide_scales)
CASES = [(1, False, 64, 64, "default", False), (5, True, 64, 64, "default", False),
         (40, True, 64, 64, "default", False), (33, False, 64, 64, "default", False),
         (3, True, 96, 64, "small", False), (21, True, 96, 64, "small", True), (21, False, 96, 64, "small", False),
         (1, True, 160, 160, "word", False), (33, True, 160, 160, "word", True),
         (3, True, 96, 96, "swap", False), (8, True, 96, 96, "swap", True),
         (1, True, 160, 160, "swap_word", False), (3, True, 160, 160, "swap_word", True),
         (8, True, 160, 160, "swap_word", False), (33, True, 160, 160, "swap_word", False),
         (1, True, 160, 160, "swap_word_m1", False), (3, True, 160, 160, "swap_word_m1", True),
         (1, False, 96, 96, "swap", False), (3, False, 96, 96, "swap", False), (8, False, 96, 96, "swap", False),
         (33, False, 96, 96, "swap", False),
         (1, True, 160, 96, "gemv", False), (3, True, 96, 160, "gemv", True), (8, True, 160, 160, "gemv", False),
         (1, False, 96, 160, "gemv", False), (8, False, 160, 96, "gemv", False)]

def fill_experts(experts, seed: int) -> None:
    """Seeded random weights in place: bf16-form weights N(0, 0.5) on gate/up, N(0, 0.1) on down;
    MXFP4 bytes uniform with scales 2^-4 .. 2^-2; biases N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in experts.named_parameters():
        if p.dtype == torch.uint8:
            low, high = (0, 256) if name.endswith("blocks") else (123, 126)
            p.data.copy_(torch.randint(low, high, p.shape, generator=g, dtype=torch.uint8))
        else:
            std = {"w13_weight": 0.5, "w2_weight": 0.1}.get(name, 0.3)
            p.data.copy_(torch.randn(p.shape, generator=g) * std)


def make_config(name: str):
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import Mxfp4MoEConfig

    return None if CONFIGS[name] is None else Mxfp4MoEConfig(**CONFIGS[name])


def _interpreted(rank: int, world: int) -> dict:
    import triton

    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton

    assert triton.knobs.runtime.interpret
    results = {}
    for seed, case in enumerate(CASES):
        tokens, mxfp4, hidden, inter, config, wide = case
        experts = GptOssExperts(8, hidden, inter, 1.702, 7.0, mxfp4, torch.float32, None)
        fill_experts(experts, seed)
        g = torch.Generator().manual_seed(100 + seed)
        if wide:
            for scales in (experts.w13_scales, experts.w2_scales):
                drawn = torch.randint(118, 128, scales.shape, generator=g, dtype=torch.uint8)
                scales.data.copy_(torch.where(torch.rand(scales.shape, generator=g) < 0.1, 0, drawn))
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(tokens)]).to(torch.int32)  # experts 6, 7 idle
        weights = torch.softmax(torch.randn(tokens, 4, generator=g), dim=-1)
        results[case] = (gpt_oss_experts_triton(x, experts, weights, ids, make_config(config)),
                         experts.forward_torch(x, weights, ids))
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "tokens{}-{}-hidden{}-inter{}-{}{}".format(
    c[0], "mxfp4" if c[1] else "bf16form", c[2], c[3], c[4], "-wide_scales" if c[5] else ""))
def test_matches_torch_reference(interpreted, case):
    out, expected = interpreted[case]
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


# TP shards: (configuration as above, hidden, full intermediate); each rank's share of the
# intermediate is a multiple of 32, one group (32) or several (64, 96), or not (80, 48: padded
# with zeros to 96 and 64, `layers.moe.gpt_oss_moe.rank_share`)
TP_CASES = [("default", 64, 128), ("small", 96, 192), ("small", 64, 64), ("swap_word", 160, 128), ("gemv", 96, 192),
            ("default", 64, 160), ("gemv", 96, 96)]


def _full_checkpoint(hidden: int, inter: int, seed: int) -> dict:
    """Seeded full expert tensors of 4 experts in the checkpoint's layout (gate/up interleaved)."""
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_blocks": torch.randint(0, 256, (4, 2 * inter, hidden // 32, 16), generator=g, dtype=torch.uint8),
            "gate_up_scales": torch.randint(123, 126, (4, 2 * inter, hidden // 32), generator=g, dtype=torch.uint8),
            "gate_up_bias": torch.randn(4, 2 * inter, generator=g) * 0.3,
            "down_blocks": torch.randint(0, 256, (4, hidden, inter // 32, 16), generator=g, dtype=torch.uint8),
            "down_scales": torch.randint(123, 126, (4, hidden, inter // 32), generator=g, dtype=torch.uint8),
            "down_bias": torch.randn(4, hidden, generator=g) * 0.3}


def _routing(hidden: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, hidden, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)]).to(torch.int32)
    return x, torch.softmax(torch.randn(9, 2, generator=g), dim=-1), ids


def _full_reference(full: dict, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The whole experts from the full checkpoint tensors, fp32: gate = even rows, up = odd rows."""
    from arfusion.layers.moe.gpt_oss_moe import clamped_swiglu
    from arfusion.layers.moe.mxfp4 import dequantize_mxfp4

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = dequantize_mxfp4(full["gate_up_blocks"][e], full["gate_up_scales"][e], torch.float32) @ x[t]
            gate_up = gate_up + full["gate_up_bias"][e]
            act = clamped_swiglu(gate_up[0::2], gate_up[1::2], 1.702, 7.0)
            down = dequantize_mxfp4(full["down_blocks"][e], full["down_scales"][e], torch.float32)
            out[t] += weights[t, j] * (down @ act + full["down_bias"][e])
    return out


def _interpreted_shard(rank: int, world: int) -> dict:
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton

    partials = {}
    for seed, (config, hidden, inter) in enumerate(TP_CASES):
        experts = GptOssExperts(4, hidden, inter, 1.702, 7.0, True, torch.float32, None)
        params = {"gate_up_blocks": experts.w13_blocks, "gate_up_scales": experts.w13_scales,
                  "gate_up_bias": experts.w13_bias, "down_blocks": experts.w2_blocks, "down_scales": experts.w2_scales,
                  "down_bias": experts.w2_bias}
        for shard_id, tensor in _full_checkpoint(hidden, inter, seed).items():
            experts.weight_loader(params[shard_id], tensor, shard_id)
        x, weights, ids = _routing(hidden, 50 + seed)
        partials[(config, hidden, inter)] = gpt_oss_experts_triton(x, experts, weights, ids, make_config(config))
    return partials


@pytest.fixture(scope="module")
def interpreted_shards():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted_shard, timeout_s=300, world_size=2)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: "{}-hidden{}-intermediate{}".format(*c))
def test_tp2_shards_sum_to_the_full_experts(interpreted_shards, case):
    """Each TP2 rank's kernel output on its shard (sharded by `GptOssExperts.weight_loader`), summed
    over the ranks, is the full experts' output from the checkpoint's tensors (RTOL, ATOL)."""
    seed = TP_CASES.index(case)
    x, weights, ids = _routing(case[1], 50 + seed)
    total = sum(rank_partials[case] for rank_partials in interpreted_shards)
    torch.testing.assert_close(total, _full_reference(_full_checkpoint(case[1], case[2], seed), x, weights, ids),
                               rtol=RTOL, atol=ATOL)
