"""The matrix-vector MoE experts (layers/moe/kernels/triton_moe_gemv.py) under Triton's CPU
interpreter, in one spawned child with TRITON_INTERPRET=1; skipped without triton.

Cases (8 experts, hidden 80, intermediate 48: ragged column and K tiles): 1 token at top-2 and
top-8 (every expert once), 3 tokens at top-3 (a slot count that is no power of two), 4 tokens at
top-8 (32 slots, the most this path serves), every slot on one expert; the default tiles and
small ones (several K steps, ragged last steps, 3 of 4 slots padded in launch 2 at top-3). In
fp32 and fp16 against the torch reference (layers/moe/torch_experts.py), whose roundings to the
dtype are the same steps (gate, up, silu, the product; then once after the weighted sum) except
the reference's rounding of each expert row before the combine: TOLERANCES (tests/tolerances.py).
bf16 on the GPU: tests/gpu/test_moe_gemv_gpu.py.

The dispatch: `fused_moe` without a config or blocks runs this path (the same bits as
`moe_gemv`) up to GEMV_MAX_SLOTS slots and a quarter as many slots as experts, with the folded
combine; the grouped launches above, with the unfused combine, and in batch-invariant mode;
`MoEExperts.block_m` then asks the routing for no grouping."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter
from tests.tolerances import TOLERANCES, assert_close

EXPERTS, HIDDEN, INTER = 8, 80, 48
# name -> (tokens, top_k, every slot on this expert or None)
CASES = {"1 token top-2": (1, 2, None), "1 token top-8": (1, 8, None), "3 tokens top-3": (3, 3, None),
         "4 tokens top-8": (4, 8, None), "one expert": (4, 1, 5)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# MoEGemvConfig's fields in order; "summed steps" (as the default): launch 1 sums each K step at
# once; "small" keeps an accumulator per output and column
TILES = {"default": None, "small": (4, 32, 8, 16, 1, 2, False), "summed steps": (8, 32, 8, 16, 2, 4, True)}


def case_inputs(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(x, w13, w2, topk_weights, topk_ids)`` of a case, seeded by its name: N(0, 1) inputs,
    weights scaled by 1/sqrt(fan-in), distinct experts per token, softmax routing weights."""
    tokens, top_k, forced = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 17 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if forced is not None:
        ids[:] = forced
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers import batch_invariant
    from arfusion.layers.moe.kernels.triton_fused_moe import block_config, fused_moe
    from arfusion.layers.moe.kernels.triton_moe_gemv import MoEGemvConfig, moe_gemv

    results = {}
    for name in CASES:
        for dtype_name, dtype in DTYPES.items():
            inputs = case_inputs(name, dtype)
            for tile, fields in TILES.items():
                config = MoEGemvConfig(*fields) if fields else MoEGemvConfig()
                results[name, dtype_name, tile] = moe_gemv(*inputs, config=config)
    inputs = case_inputs("1 token top-2", torch.float32)  # 2 slots: a quarter of the 8 experts
    results["dispatch", "default"] = fused_moe(*inputs)
    results["dispatch", "grouped"] = fused_moe(*inputs, config=block_config(2, EXPERTS))
    with batch_invariant.batch_invariant_mode(True):
        results["dispatch", "batch-invariant"] = fused_moe(*inputs)
    inputs = case_inputs("3 tokens top-3", torch.float32)  # 9 slots: more than a quarter
    results["dispatch", "many slots"] = fused_moe(*inputs)
    results["dispatch", "many slots grouped"] = fused_moe(*inputs, config=block_config(9, EXPERTS))
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=400)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_reference(interpreted, name, dtype_name, tile):
    from arfusion.layers.moe.torch_experts import moe_experts_torch

    inputs = case_inputs(name, DTYPES[dtype_name])
    out = interpreted[name, dtype_name, tile]
    assert out.dtype == DTYPES[dtype_name] and out.shape == (CASES[name][0], HIDDEN)
    assert_close(out, moe_experts_torch(*inputs), TOLERANCES)


@pytest.mark.timeout(500)
def test_fused_moe_takes_this_path_only_where_it_serves(interpreted):
    assert torch.equal(interpreted["dispatch", "default"], interpreted["1 token top-2", "fp32", "default"])
    assert not torch.equal(interpreted["dispatch", "default"], interpreted["dispatch", "grouped"])  # other sums
    assert torch.equal(interpreted["dispatch", "batch-invariant"], interpreted["dispatch", "grouped"])
    assert torch.equal(interpreted["dispatch", "many slots"], interpreted["dispatch", "many slots grouped"])


def test_uses_gemv_by_slots_combine_and_mode():
    pytest.importorskip("triton")
    from arfusion.layers import batch_invariant
    from arfusion.layers.moe.kernels.triton_fused_moe import uses_gemv
    from arfusion.layers.moe.kernels.triton_moe_gemv import GEMV_MAX_SLOTS

    assert uses_gemv(1, 128) and uses_gemv(GEMV_MAX_SLOTS, 128) and not uses_gemv(GEMV_MAX_SLOTS + 1, 256)
    assert uses_gemv(2, 8) and not uses_gemv(3, 8) and not uses_gemv(1, 3)  # at most a quarter of the experts
    assert not uses_gemv(8, 128, "unfused")
    with batch_invariant.batch_invariant_mode(True):
        assert not uses_gemv(8, 128)


def test_bad_tiles_are_refused_by_name():
    pytest.importorskip("triton")
    from arfusion.layers.moe.kernels.triton_moe_gemv import MoEGemvConfig, moe_gemv

    with pytest.raises(ValueError, match="block_k_down must be a power of two"):
        moe_gemv(*case_inputs("1 token top-2", torch.float32), config=MoEGemvConfig(block_k_down=48))
