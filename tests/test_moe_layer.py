"""The MoE layer on the CPU: routing, the grouping of slots by expert, the torch experts and
the unfused combine; and the helpers of the TP checks of the whole `SparseMoeBlock` at TP1, TP2
and TP4 (gloo) against a dense float64 reference that loops over tokens and their experts, which
run in tests/test_moe_model.py's ranks (one spawn per TP size serves both files).

Each TP rank returns its partial sum; the test sums them (the all-reduce the caller owes) and
compares with the reference. 8 experts, top-2, hidden 64, expert intermediate 32 (8 columns per
rank at TP4); 12 tokens, and 2 tokens (so at least half of the experts get none).
"""
import pytest
import torch
import torch.nn.functional as F

from arfusion.layers.moe import MoEExperts, SparseMoeBlock, combine_topk, expert_outputs, moe_experts_torch, select_experts
from arfusion.layers.moe.align import align_by_expert, max_padded_rows
from arfusion.layers.parallel_state import get_tp_group

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 32
TOKEN_COUNTS = (2, 12)


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-layout full tensors: router ``[E, H]``, per expert gate/up ``[I, H]`` and down ``[H, I]``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(EXPERTS, HIDDEN, generator=g),
        "gate_proj": torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN ** 0.5,
        "up_proj": torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN ** 0.5,
        "down_proj": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5,
    }


def layer_input(tokens: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))


def reference(x: torch.Tensor, w: dict[str, torch.Tensor], renormalize: bool) -> torch.Tensor:
    """The MoE output ``[T, H]`` in float64, one token and one expert at a time."""
    x = x.double()
    probs = torch.softmax(x @ w["gate"].double().T, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = torch.topk(probs[t], TOP_K)
        weights = top.values / top.values.sum() if renormalize else top.values
        for weight, e in zip(weights, top.indices):
            gate, up = w["gate_proj"][e].double() @ x[t], w["up_proj"][e].double() @ x[t]
            out[t] += weight * (w["down_proj"][e].double() @ (F.silu(gate) * up))
    return out


def _load_block(block: SparseMoeBlock, w: dict[str, torch.Tensor]) -> None:
    block.gate.weight.weight_loader(block.gate.weight, w["gate"])
    experts = block.experts
    for part, param in (("gate", experts.w13_weight), ("up", experts.w13_weight), ("down", experts.w2_weight)):
        for e in range(EXPERTS):
            param.weight_loader(param, w[f"{part}_proj"][e], (e, part))


def block_results() -> dict:
    """(In a TP rank.) This rank's partial `SparseMoeBlock` outputs for both routings and token
    counts, the all-reduced one, and the messages of `_loader_errors`; checked by
    tests/test_moe_model.py, whose ranks run this too (one spawn per TP size for both files)."""
    w = full_weights()
    partials = {}
    for renormalize in (True, False):
        block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, renormalize, dtype=torch.float32)
        _load_block(block, w)
        for tokens in TOKEN_COUNTS:
            partials[renormalize, tokens] = block(layer_input(tokens))
    reduced = partials[True, TOKEN_COUNTS[-1]].clone()
    get_tp_group().all_reduce(reduced)
    return {"partials": partials, "all_reduced": reduced, "load_errors": _loader_errors()}


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_fp32_softmax_top_k(renormalize):
    logits = torch.randn(5, EXPERTS, generator=torch.Generator().manual_seed(2)).bfloat16()
    weights, ids = select_experts(logits, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (5, 3)
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(3, dim=-1)
    assert torch.equal(ids.long(), top.indices)
    expected = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, EXPERTS + 1, renormalize)


ALIGN_CASES = {
    "one token": torch.tensor([[3, 5]]),
    "experts without tokens": torch.tensor([[0, 7], [7, 1], [0, 1]]),
    "all on one expert": torch.tensor([[2], [2], [2], [2], [2]]),
    "random": torch.randint(0, EXPERTS, (40, 1), generator=torch.Generator().manual_seed(3)),
}


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("case", list(ALIGN_CASES))
def test_align_groups_every_slot_once_in_whole_blocks(case, block_m):
    ids = ALIGN_CASES[case]
    slots = ids.numel()
    blocks = align_by_expert(ids.to(torch.int32), EXPERTS, block_m)
    rows = blocks.sorted_slots.long()
    used = int(blocks.num_rows)
    assert rows.numel() == max_padded_rows(slots, EXPERTS, block_m) >= used and used % block_m == 0
    assert sorted(rows[rows < slots].tolist()) == list(range(slots)), "each slot in exactly one row"
    assert bool((rows[used:] == slots).all()), "rows past num_rows are padding"
    flat = ids.flatten()
    for b in range(used // block_m):
        block = rows[b * block_m:(b + 1) * block_m]
        real = block[block < slots]
        assert real.numel() > 0, "no block of padding only below num_rows"
        assert bool((flat[real] == int(blocks.block_expert[b])).all()), "a block holds one expert's slots"
        assert real.tolist() == sorted(real.tolist()) and bool((block[:real.numel()] == real).all())


def test_torch_experts_and_the_unfused_combine():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, HIDDEN, generator=g).bfloat16()
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / 8).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / 6).bfloat16()
    weights, ids = select_experts(torch.randn(6, EXPERTS, generator=g), TOP_K, True)
    y = expert_outputs(x, w13, w2, ids)
    for t in range(6):
        for j in range(TOP_K):
            e = int(ids[t, j])
            gate, up = (x[t] @ w13[e].T).chunk(2)
            assert torch.equal(y[t, j], (F.silu(gate) * up) @ w2[e].T)
    out = moe_experts_torch(x, w13, w2, weights, ids)
    assert torch.equal(out, combine_topk(y, weights))
    expected = y[:, 0].double() * weights[:, :1].double() + y[:, 1].double() * weights[:, 1:].double()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-6)  # one rounding to bf16
    assert moe_experts_torch(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, HIDDEN)


def _loader_errors() -> list[str]:
    experts = MoEExperts(EXPERTS, HIDDEN, INTER, torch.float32)
    w13, w2 = experts.w13_weight, experts.w2_weight
    cases = [
        (w13, torch.ones(INTER, HIDDEN + 1), (0, "gate")),
        (w13, torch.ones(INTER, HIDDEN), (EXPERTS, "up")),
        (w13, torch.ones(INTER, HIDDEN), (0, "w1")),
        (w2, torch.ones(INTER, HIDDEN), (0, "gate")),
        (w2, torch.ones(HIDDEN + 1, INTER), (0, "down")),
    ]
    messages = []
    for param, tensor, shard in cases:
        with pytest.raises(ValueError) as err:
            param.weight_loader(param, tensor, shard)
        messages.append(str(err.value))
    if get_tp_group().world_size > 1:
        with pytest.raises(ValueError, match="expert intermediate size"):
            MoEExperts(EXPERTS, HIDDEN, INTER + 1, torch.float32)
    return messages
