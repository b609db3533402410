"""The Triton fused MoE (layers/moe/kernels/triton_fused_moe.py) under Triton's CPU interpreter, against
the torch reference (layers/moe/torch_experts.py) and a float64 truth.

Skipped when triton is not installed. As in tests/test_triton_elementwise.py the interpreter must
be chosen before triton is imported, so every case runs in one spawned process with
TRITON_INTERPRET=1 and each parametrized test checks its own case's result.

Cases (8 experts, hidden 80, expert intermediate 48, so that the column and K tiles have ragged
edges): 1, 7 and 64 tokens at top-2 (1 token: six experts with no token; 64 tokens: 16 slots per
expert on average, so experts span several 16-row blocks), every token on expert 3 (top-1: one
expert, 40 rows, the others empty) and every token's first slot on expert 3 (top-2). Each in
fp32, fp16 and bf16 with the folded combine (in the down launch's epilogue) and the unfused one,
with the default tiles; fp16 also with 16 x 32 x 32 tiles (several K steps, ragged tiles).

- fp32 and fp16: both combines equal the torch reference to the dtype's rounding (the same
  rounding steps, round to nearest in both; only the summation order differs); in fp16 the
  unfused combine, which rounds exactly where the reference rounds, within two ulps at the
  outputs' scale (tests/tolerances.py SAME_ROUNDINGS). Not bit for bit: the order of the CPU
  GEMM's fp32 sums differs by torch version and CPU kernel (bit-equal shares of 0.975 to 1.0),
  and the arithmetic guarantees equality only for equal orders.
The grouping of slots by expert in one launch (layers/moe/kernels/triton_align.py, a program per
expert) equals the torch version (layers/moe/align.py) tensor for tensor: one token, 1 of 128
experts hit by top-8, every token on one expert, 60 experts (not a power of two), 2048 slots (the
largest fused_moe gives it: two 1,024-slot chunks a program) and 3000 slots on 3 of 32 experts
(three chunks; an expert's rows span many blocks), at 16- and 64-row blocks.

- bf16: the interpreter casts fp32 -> bf16 by truncation where the GPU and torch round to
  nearest, and truncation's errors do not cancel (about 5x the reference's error here), so
  checked is the error against the float64 truth: within 8x the torch reference's (a wrong
  expert, row or weight is off by O(1)), and the folded combine's at most 1.5x the unfused
  combine's (it skips one rounding to bf16). tests/gpu/test_fused_moe.py checks bf16 on the GPU.
"""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from arfusion.layers.moe.align import align_by_expert  # noqa: E402
from arfusion.layers.moe.router import select_experts  # noqa: E402
from arfusion.layers.moe.torch_experts import moe_experts_torch  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402
from tests.tolerances import SAME_ROUNDINGS, TOLERANCES, assert_close  # noqa: E402

EXPERTS, HIDDEN, INTER = 8, 80, 48
# name -> (tokens, top_k, expert forced into slot 0 of every token or None)
CASES = {
    "1 token": (1, 2, None),
    "7 tokens": (7, 2, None),
    "64 tokens": (64, 2, None),
    "all on one expert, top-1": (40, 1, 3),
    "slot 0 on one expert": (24, 2, 3),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMBINES = ("folded", "unfused")
RUNS = [(d, c, "default") for d in DTYPES for c in COMBINES] + [("fp16", c, "small") for c in COMBINES]


def case_inputs(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(x, w13, w2, topk_weights, topk_ids)`` of a case, seeded by its name."""
    tokens, top_k, forced = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 31 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5
    logits = torch.randn(tokens, EXPERTS, generator=g)
    if forced is not None:  # the top logit by a margin of 0.5: slot 0, with a weight short of 1
        logits[:, forced] = logits.max(dim=1).values + 0.5
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


def truth(x, w13, w2, weights, ids) -> torch.Tensor:
    """float64 of the same (already rounded) inputs, token by token."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


# name -> (num_experts, topk_ids)
ALIGN_CASES = {
    "one token": (8, torch.tensor([[3, 5]])),
    "one token, 128 experts, top-8": (128, torch.randperm(128, generator=torch.Generator().manual_seed(0))[:8][None]),
    "all on one expert": (8, torch.full((5, 1), 2)),
    "60 experts": (60, torch.stack([torch.randperm(60, generator=torch.Generator().manual_seed(t))[:4] for t in range(33)])),
    "2048 slots": (128, torch.stack([torch.randperm(128, generator=torch.Generator().manual_seed(t))[:8] for t in range(256)])),
    "3000 slots on 3 of 32 experts": (32, torch.randint(0, 3, (1500, 2), generator=torch.Generator().manual_seed(0))),
}
ALIGN_BLOCKS = (16, 64)


def _interpreted_cases(rank: int, world: int) -> dict:
    from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton
    from arfusion.layers.moe.kernels.triton_fused_moe import MoEBlockConfig, fused_moe

    tiles = {"default": None, "small": MoEBlockConfig(block_m=16, block_n_gate_up=32, block_k_gate_up=32,
                                                      block_n_down=32, block_k_down=32)}
    results = {}
    for name in CASES:
        for dtype_name, combine, tile in RUNS:
            inputs = case_inputs(name, DTYPES[dtype_name])
            results[name, dtype_name, combine, tile] = fused_moe(*inputs, combine=combine, config=tiles[tile])
    for name, (experts, ids) in ALIGN_CASES.items():
        for block_m in ALIGN_BLOCKS:
            blocks = align_by_expert_triton(ids.to(torch.int32), experts, block_m)
            results["align", name, block_m] = (blocks.sorted_slots, blocks.block_expert, blocks.num_rows)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(_interpreted_cases, timeout_s=400)


def _max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.double() - expected).abs().max().item()


@pytest.mark.parametrize("dtype_name,combine,tile", [r for r in RUNS if r[0] != "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_equals_torch_reference(interpreted, name, dtype_name, combine, tile):
    inputs = case_inputs(name, DTYPES[dtype_name])
    out = interpreted[name, dtype_name, combine, tile]
    expected = moe_experts_torch(*inputs)
    assert out.dtype == DTYPES[dtype_name] and out.shape == (CASES[name][0], HIDDEN)
    assert_close(out, expected, SAME_ROUNDINGS if (dtype_name, combine) == ("fp16", "unfused") else TOLERANCES)


@pytest.mark.parametrize("block_m", ALIGN_BLOCKS)
@pytest.mark.parametrize("name", list(ALIGN_CASES))
def test_align_kernel_equals_torch_align(interpreted, name, block_m):
    experts, ids = ALIGN_CASES[name]
    expected = align_by_expert(ids.to(torch.int32), experts, block_m)
    sorted_slots, block_expert, num_rows = interpreted["align", name, block_m]
    assert torch.equal(sorted_slots, expected.sorted_slots)
    assert torch.equal(block_expert, expected.block_expert)
    assert torch.equal(num_rows, expected.num_rows)


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_error_against_float64_truth(interpreted, name, combine):
    inputs = case_inputs(name, torch.bfloat16)
    expected = truth(*inputs)
    out = interpreted[name, "bf16", combine, "default"]
    assert out.dtype == torch.bfloat16
    assert _max_error(out, expected) <= 8 * _max_error(moe_experts_torch(*inputs), expected)


@pytest.mark.parametrize("name", list(CASES))
def test_folded_combine_no_worse_than_unfused(interpreted, name):
    expected = truth(*case_inputs(name, torch.bfloat16))
    folded = _max_error(interpreted[name, "bf16", "folded", "default"], expected)
    unfused = _max_error(interpreted[name, "bf16", "unfused", "default"], expected)
    assert folded <= 1.5 * unfused, (folded, unfused)
