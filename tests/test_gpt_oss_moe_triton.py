"""gpt-oss's experts in Triton (layers/moe/kernels/triton_mxfp4_moe.py), bf16-form and MXFP4
weights, against the torch reference (`GptOssExperts.forward_torch`) under Triton's CPU
interpreter, fp32 activations (the interpreter's bf16 dots multiply bit patterns; bf16 runs in
tests/gpu/test_gpt_oss_gpu.py). One spawned child with TRITON_INTERPRET=1; skipped without
triton. Routing: random top-4 of 8 experts, some experts without tokens, token counts across
one and several row blocks; weights and biases seeded random, gate/up spread to reach the
SwiGLU's clamps. Shapes: hidden = intermediate = 64 with the default tiles (one K-tile, masked
columns), and hidden 96 with small tiles (several K-tiles and column tiles, a masked K tail);
MXFP4 scales 2^-4 .. 2^-2, or 2^-9 .. 2^0 with some scale bytes 0 (2^-127).

Tolerance: rtol = atol = 1e-4. The dequantized weights are exact, but the kernel sums each
fp32 dot in its own order (even columns, then odd ones, per K-tile) where the reference sums
the whole row: pre-activations of tens differ by a few fp32 ulps, which the SwiGLU's slope (up
to about 8) and the down projection carry to the outputs (up to a few hundred here). Measured
on the 2-core CPU: at most a quarter of the tolerance (the wide-scale case), the others a tenth
or less."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter

RTOL = ATOL = 1e-4
SMALL_TILES = dict(block_m=16, block_n_gate_up=16, block_k_gate_up=64, block_n_down=16, block_k_down=32,
                   num_warps=4, num_stages=1)
# (tokens, mxfp4, hidden, small_tiles: SMALL_TILES instead of the default tiles, wide_scales)
CASES = [(1, False, 64, False, False), (5, True, 64, False, False), (40, True, 64, False, False),
         (40, False, 64, False, False), (3, True, 96, True, False), (21, True, 96, True, True),
         (21, False, 96, True, False)]


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


def _interpreted(rank: int, world: int) -> dict:
    import triton

    from layers.moe.gpt_oss_moe import GptOssExperts
    from layers.moe.kernels.triton_fused_moe import MoEBlockConfig
    from layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton

    assert triton.knobs.runtime.interpret
    results = {}
    for seed, (tokens, mxfp4, hidden, small_tiles, wide) in enumerate(CASES):
        experts = GptOssExperts(8, hidden, 64, 1.702, 7.0, mxfp4, torch.float32, None)
        fill_experts(experts, seed)
        g = torch.Generator().manual_seed(100 + seed)
        if wide:
            for scales in (experts.w13_scales, experts.w2_scales):
                drawn = torch.randint(118, 128, scales.shape, generator=g, dtype=torch.uint8)
                scales.data.copy_(torch.where(torch.rand(scales.shape, generator=g) < 0.1, 0, drawn))
        x = torch.randn(tokens, hidden, generator=g)
        ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(tokens)]).to(torch.int32)  # experts 6, 7 idle
        weights = torch.softmax(torch.randn(tokens, 4, generator=g), dim=-1)
        config = MoEBlockConfig(**SMALL_TILES) if small_tiles else None
        results[(tokens, mxfp4, hidden, small_tiles, wide)] = (gpt_oss_experts_triton(x, experts, weights, ids, config),
                                                               experts.forward_torch(x, weights, ids))
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "tokens{}-{}-hidden{}{}{}".format(
    c[0], "mxfp4" if c[1] else "bf16form", c[2], "-small_tiles" if c[3] else "", "-wide_scales" if c[4] else ""))
def test_matches_torch_reference(interpreted, case):
    out, expected = interpreted[case]
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
