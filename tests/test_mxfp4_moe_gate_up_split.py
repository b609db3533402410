"""K splits of gpt-oss's gate/up projection in the experts kernel (`Mxfp4MoEConfig.split_k_gate_up`,
layers/moe/kernels/triton_mxfp4_moe.py): the fp32 partial gate/up sums, summed in split order
(or added by atomics, ``gate_up_atomic``), then bias and clamped SwiGLU in the down launch's
prologue, against the torch reference (`GptOssExperts.forward_torch`: dequantize, matmul,
activation) under Triton's CPU interpreter, fp32 activations (the interpreter's bf16 dots
multiply bit patterns; bf16 on the GPU: tests/gpu/test_mxfp4_moe_variants.py). One spawned child
with TRITON_INTERPRET=1; skipped without triton.

Small shapes: hidden 128 or 64, intermediate 64, 8 experts of which 6 and 7 get no tokens, top-4,
1 / 3 / 8 / 33 tokens; seeded random weights (MXFP4 bytes uniform, scales 2^-4 .. 2^-2; bf16-form
N(0, 0.5)), biases, activations, routing. Splits 1 / 2 / 4 summed in order, 3 and 4 by atomics,
in both orientations (`swap`), MXFP4 and bf16-form weights; hidden 128 in K steps of 32 is 4
K-tiles: 4 splits of one tile each, 2 of two, 3 of two, two and no tiles.

Tolerance: rtol = atol = 1e-4, as tests/test_gpt_oss_moe_triton.py (the dequantized weights are
exact; the partial sums add each fp32 dot's K range in another order than the reference's whole
row, a few fp32 ulps of pre-activations of tens, carried by the SwiGLU and down to outputs of up
to a few hundred). Measured on a 2-core CPU: the largest ``|out - ref| / (atol + rtol * |ref|)``
of a case at most 0.36. And bit for bit: a split count that leaves every split but the first
empty (hidden 64 in one K-tile of 64, two splits) gives the unsplit kernel's bits, so the
prologue's bias, roundings and activation are the unsplit epilogue's.

The configuration rules run without the interpreter: batch-invariant mode keeps the gate/up
projection unsplit (the default chooser returns ``split_k_gate_up`` 1 whatever its decode table
holds, and a configuration that splits it is a ValueError there), and the limits of the new
fields."""
import dataclasses

import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter

RTOL = ATOL = 1e-4
BYTES = dict(block_m=16, block_n_gate_up=32, block_k_gate_up=32, block_n_down=64, block_k_down=32, num_warps=4,
             num_stages=2)
SWAP = dict(block_m=8, block_n_gate_up=32, block_k_gate_up=32, block_n_down=64, block_k_down=32, swap=True,
            split_k_down=2)
# name: (tile fields, split_k_gate_up, gate_up_atomic)
CONFIGS = {"bytes_split1": (BYTES, 1, False), "bytes_split2": (BYTES, 2, False), "bytes_split4": (BYTES, 4, False),
           "bytes_split4_atomic": (BYTES, 4, True), "swap_split2": (SWAP, 2, False), "swap_split4": (SWAP, 4, False),
           "swap_split3_atomic": (SWAP, 3, True)}
TOKENS = (1, 3, 8, 33)
# (configuration, tokens, mxfp4): every split of the byte-decoder tiles at every token count (the
# unsplit kernel at the two ends: tests/test_gpt_oss_moe_triton.py covers it), the swapped
# orientation at fewer (its token blocks of 8 make many programs at 33 tokens under the interpreter)
CASES = ([(name, tokens, True) for name in ("bytes_split2", "bytes_split4", "bytes_split4_atomic") for tokens in TOKENS]
         + [("bytes_split1", 1, True), ("bytes_split1", 33, True), ("swap_split2", 1, True), ("swap_split2", 8, True),
            ("swap_split4", 3, True), ("swap_split3_atomic", 8, True), ("bytes_split2", 3, False),
            ("swap_split4", 8, False)])
# (tokens, mxfp4) at hidden 64: split 2 of one K-tile of 64 against split 1, bit for bit
EMPTY_SPLIT_CASES = [(3, True), (8, False)]
EMPTY_SPLIT_TILES = dict(block_m=16, block_n_gate_up=32, block_k_gate_up=64, block_n_down=32, block_k_down=32)


def _config(name: str):
    from arfusion.layers.moe.kernels.mxfp4_moe_config import Mxfp4MoEConfig

    tiles, splits, atomic = CONFIGS[name]
    return Mxfp4MoEConfig(**tiles, split_k_gate_up=splits, gate_up_atomic=atomic)


def _problem(tokens: int, mxfp4: bool, hidden: int, seed: int):
    """Experts (8, ``hidden``, intermediate 64, fp32) with seeded random weights and an input of
    ``tokens`` rows routed to experts 0-5 (6 and 7 idle)."""
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from tests.test_gpt_oss_moe_triton import fill_experts

    experts = GptOssExperts(8, hidden, 64, 1.702, 7.0, mxfp4, torch.float32, None)
    fill_experts(experts, seed)
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(tokens)]).to(torch.int32)
    return experts, x, torch.softmax(torch.randn(tokens, 4, generator=g), dim=-1), ids


def _interpreted(rank: int, world: int) -> dict:
    import triton

    from arfusion.layers.moe.kernels.mxfp4_moe_config import Mxfp4MoEConfig
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton

    assert triton.knobs.runtime.interpret
    results = {}
    for seed, case in enumerate(CASES):
        name, tokens, mxfp4 = case
        experts, x, weights, ids = _problem(tokens, mxfp4, 128, seed)
        results[case] = (gpt_oss_experts_triton(x, experts, weights, ids, _config(name)),
                         experts.forward_torch(x, weights, ids))
    for seed, case in enumerate(EMPTY_SPLIT_CASES):
        experts, x, weights, ids = _problem(*case, 64, 50 + seed)
        results[("empty_split",) + case] = tuple(
            gpt_oss_experts_triton(x, experts, weights, ids, Mxfp4MoEConfig(**EMPTY_SPLIT_TILES, split_k_gate_up=s))
            for s in (1, 2))
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "{}-tokens{}-{}".format(c[0], c[1], "mxfp4" if c[2] else "bf16form"))
def test_gate_up_split_matches_torch_reference(interpreted, case):
    out, expected = interpreted[case]
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", EMPTY_SPLIT_CASES,
                         ids=lambda c: "tokens{}-{}".format(c[0], "mxfp4" if c[1] else "bf16form"))
def test_split_with_one_nonempty_split_gives_the_unsplit_bits(interpreted, case):
    unsplit, split = interpreted[("empty_split",) + case]
    assert torch.equal(unsplit, split)


def test_batch_invariant_default_keeps_gate_up_unsplit(monkeypatch):
    from arfusion.layers.moe.kernels import mxfp4_moe_config as mc

    entry = mc.Mxfp4MoEConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32,
                              block_k_down=128, split_k_gate_up=4, gate_up_atomic=True, num_stages=5)
    monkeypatch.setattr(mc, "DECODE_CONFIGS", ((8.0, entry),))
    assert mc.experts_block_config(64, 32, True) == entry  # past the matrix-vector launches' slots
    assert mc.experts_block_config(64, 32, True, deterministic=True) == dataclasses.replace(
        entry, split_k_gate_up=1, gate_up_atomic=False)
    # past the decode table: the prefill tiles, unsplit either way
    assert mc.experts_block_config(2048, 32, True, deterministic=True).split_k_gate_up == 1


@pytest.mark.parametrize(("fields", "deterministic", "message"), [
    (dict(split_k_gate_up=2), True, "batch-invariant mode keeps the gate/up projection unsplit"),
    (dict(split_k_gate_up=0), False, "split_k_gate_up must be at least 1"),
    (dict(gate_up_atomic=True), False, "gate_up_atomic needs split_k_gate_up above 1"),
    (dict(num_stages_down=-1), False, "num_stages_down must be at least 0"),
    (dict(num_warps=0), False, "num_warps must be at least 1"),
])
def test_check_config_refuses(fields, deterministic, message):
    from arfusion.layers.moe.kernels.mxfp4_moe_config import Mxfp4MoEConfig, check_config

    with pytest.raises(ValueError, match=message):
        check_config(Mxfp4MoEConfig(**{**BYTES, **fields}), mxfp4=True, deterministic=deterministic)


def test_check_config_allows_gate_up_splits_outside_batch_invariant_mode():
    from arfusion.layers.moe.kernels.mxfp4_moe_config import Mxfp4MoEConfig, check_config

    for name in CONFIGS:
        check_config(_config(name), mxfp4=True)
    check_config(Mxfp4MoEConfig(**BYTES, num_warps_down=8, num_stages_down=5), mxfp4=True, deterministic=True)


def test_split_config_refused_in_batch_invariant_mode():
    """The kernel's entry point asks the mode itself: a split gate/up configuration is refused
    before any launch in batch-invariant mode."""
    pytest.importorskip("triton")
    from arfusion.layers import batch_invariant
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton
    from arfusion.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(1, 0, device=torch.device("cpu"))
    try:
        experts, x, weights, ids = _problem(3, True, 64, 0)
        with batch_invariant.batch_invariant_mode(True), pytest.raises(ValueError, match="unsplit"):
            gpt_oss_experts_triton(x, experts, weights, ids, _config("bytes_split2"))
    finally:
        destroy_tensor_parallel()
