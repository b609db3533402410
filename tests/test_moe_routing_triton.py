"""The Triton routing (layers/moe/kernels/triton_router.py) under Triton's CPU interpreter, against
the torch reference (layers/moe/router.py, layers/moe/align.py). Skipped without triton; every
case runs in one spawned process with TRITON_INTERPRET=1 (see tests/test_moe_triton.py).

Cases: 8 experts top-2, 60 experts top-4 (not a power of two) and 128 experts top-8, hidden 80
(one ragged K tile) and 300 (three, the last ragged); 1 token (the one-launch path by default), 7,
9 and 24 tokens on the one-launch path asked for (24 tokens of 128 experts: three of its last
program's selection steps); 5 and 33 tokens (three token tiles) of 128 experts and 300 of 8 on the
default two-launch path; fp32 and bf16 inputs; renormalised or not;
and ties: experts 2, 5 and 6 share one gate row that wins every token, so their logits are equal
bit for bit and they take the first three slots, lowest index first.

- logits: against `router_logits_torch` (fp32 products and sums; bf16 products are exact in fp32)
  within (1e-5, 1e-5): only the order of the fp32 sums differs;
- ids: equal to `select_experts` of the kernel's own logits (the tie rule, exactly); weights
  within (1e-5, 1e-5) of its weights (fp32 exp and sums in another order);
- the grouping by expert: equal to `align_by_expert` of the ids, tensor for tensor (16- and
  64-row blocks), on the one-launch path; None on the two-launch path;
- the arrival counter is zero again after every call;
- `select_experts_triton` on integer-valued logits (many ties): ids equal, weights within (1e-5, 1e-5).
"""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.moe.align import align_by_expert  # noqa: E402
from arfusion.layers.moe.router import router_logits_torch, select_experts  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-5)
SHAPES = {"8 experts top-2": (8, 2), "60 experts top-4": (60, 4), "128 experts top-8": (128, 8)}
# name -> (shape, hidden, tokens, dtype, renormalize, ties, block_m); the cases named "(one launch)"
# ask `route_triton` for that path, the others take its default
CASES = {
    "1 token": ("128 experts top-8", 80, 1, torch.float32, True, False, 16),
    "7 tokens, 60 experts (one launch)": ("60 experts top-4", 300, 7, torch.float32, False, False, 16),
    "24 tokens (one launch)": ("128 experts top-8", 300, 24, torch.float32, True, False, 64),
    "33 tokens": ("128 experts top-8", 300, 33, torch.float32, True, False, 64),
    "24 tokens bf16 (one launch)": ("128 experts top-8", 300, 24, torch.bfloat16, True, False, 16),
    "8 experts bf16 (one launch)": ("8 experts top-2", 80, 7, torch.bfloat16, True, False, 16),
    "ties (one launch)": ("128 experts top-8", 80, 9, torch.float32, True, True, 16),
    "ties bf16, 60 experts": ("60 experts top-4", 300, 5, torch.bfloat16, False, True, 16),
    "300 tokens": ("8 experts top-2", 80, 300, torch.float32, True, True, 16),
}
TIED = (2, 5, 6)


def case_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h [T, hidden], gate weight [E, hidden])`` of a case, seeded by its name."""
    shape, hidden, tokens, dtype, _, ties, _ = CASES[name]
    experts, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(len(name) * 7 + tokens)
    h = torch.randn(tokens, hidden, generator=g)
    weight = torch.randn(experts, hidden, generator=g) / hidden ** 0.5
    if ties:  # a shared row along h's mean direction: the tied experts win every token
        h += 1.0
        weight[list(TIED)] = 4.0 * torch.rand(hidden, generator=g) / hidden ** 0.5
    return h.to(dtype), weight.to(dtype)


def one_launch(name: str) -> bool:
    """Whether the case's routing takes the one-launch path (asked for, or the default at 1 token)."""
    return name.endswith("(one launch)") or CASES[name][2] == 1


def tied_logits(tokens: int, experts: int) -> torch.Tensor:
    return torch.randint(0, 3, (tokens, experts), generator=torch.Generator().manual_seed(tokens)).float()


SELECT_CASES = [(5, 8, 2, True), (40, 128, 8, True), (40, 60, 4, False)]  # (tokens, experts, top_k, renormalize)


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.moe.kernels.triton_router import route_triton_with_logits, select_experts_triton

    results = {}
    for name, (shape, _, _, _, renormalize, _, block_m) in CASES.items():
        h, weight = case_inputs(name)
        counter = torch.zeros(1, dtype=torch.int32)
        weights, ids, blocks, logits = route_triton_with_logits(h, weight, SHAPES[shape][1], renormalize, counter,
                                                                block_m, one_launch=True if name.endswith("(one launch)") else None)
        results[name] = (weights, ids, blocks, logits, int(counter))
    for tokens, experts, top_k, renormalize in SELECT_CASES:
        results["select", tokens, experts] = select_experts_triton(tied_logits(tokens, experts), top_k, renormalize)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(_interpreted, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_routing_equals_torch_reference(interpreted, name):
    shape, _, tokens, _, renormalize, ties, block_m = CASES[name]
    experts, top_k = SHAPES[shape]
    h, weight = case_inputs(name)
    weights, ids, blocks, logits, counter = interpreted[name]
    assert counter == 0, "the arrival counter is zero again"
    assert logits.shape == (tokens, experts) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, router_logits_torch(h, weight), **FP32)
    expected_weights, expected_ids = select_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **FP32)
    if ties:
        first = min(top_k, len(TIED))
        assert bool((ids[:, :first] == torch.tensor(TIED[:first], dtype=torch.int32)).all()), "lowest index first"
    if not one_launch(name):
        assert blocks is None
        return
    expected = align_by_expert(ids, experts, block_m)
    assert blocks.block_m == block_m
    for field in ("sorted_slots", "block_expert", "num_rows"):
        assert torch.equal(getattr(blocks, field), getattr(expected, field)), field


@pytest.mark.parametrize("tokens,experts,top_k,renormalize", SELECT_CASES)
def test_select_on_tied_logits(interpreted, tokens, experts, top_k, renormalize):
    weights, ids = interpreted["select", tokens, experts]
    expected_weights, expected_ids = select_experts(tied_logits(tokens, experts), top_k, renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **FP32)


def test_bad_inputs_are_named():
    from arfusion.layers.moe.kernels.triton_router import route_triton, select_experts_triton

    counter = torch.zeros(1, dtype=torch.int32)
    h, weight = torch.randn(3, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="top_k"):
        route_triton(h, weight, 9, True, counter)
    with pytest.raises(ValueError, match="one dtype"):
        route_triton(h.bfloat16(), weight, 2, True, counter)
    with pytest.raises(ValueError, match=r"\[E, hidden\]"):
        route_triton(h, torch.randn(8, 12), 2, True, counter)
    with pytest.raises(ValueError, match="counter"):
        route_triton(h, weight, 2, True, counter.long())
    with pytest.raises(ValueError, match="fp32"):
        select_experts_triton(torch.randn(3, 8).bfloat16(), 2, True)


def test_fused_moe_refuses_blocks_of_another_size():
    """Blocks grouped for another block_m (or slot count) are refused before any launch."""
    from arfusion.layers.moe.kernels.triton_fused_moe import default_block_config, fused_moe

    x, w13, w2 = torch.randn(3, 16), torch.randn(8, 24, 16), torch.randn(8, 16, 12)
    weights, ids = select_experts(torch.randn(3, 8), 2, True)
    block_m = default_block_config(6, 8).block_m
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2, weights, ids, blocks=align_by_expert(ids, 8, 2 * block_m))
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2, weights, ids, blocks=align_by_expert(ids[:2], 8, block_m))
