"""Greedy tokens over vocabulary shards (`layers.sharded_logits`) equal torch.argmax of the
gathered logits, ties included (first occurrence), at TP1, TP2 and TP4 over gloo; the two-level
row maximum alone at widths with and without power-of-two factors."""
import pytest
import torch

from arfusion.layers.sharded_logits import _row_max, sharded_logits
from tests.dist_utils import run_distributed

ROWS, VOCAB = 6, 96


def full_logits() -> torch.Tensor:
    """Random logits with ties: row 1 has its maximum in two shards (at TP2 and TP4), row 2 twice
    in one shard, row 3 in every column, row 4 with integer-valued bf16-like entries."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, VOCAB, generator=g)
    x[1, [70, 5, 40]] = x[1].max() + 1.0  # first occurrence: 5
    x[2, [30, 29]] = x[2].max() + 0.5  # both in the first half at TP2: 29
    x[3] = 0.25
    x[4] = torch.randint(-3, 4, (VOCAB,), generator=g).float()
    return x


def _greedy_on_rank(rank: int, world: int) -> dict:
    x = full_logits()
    width = VOCAB // world
    out = sharded_logits(x[:, rank * width:(rank + 1) * width].clone(), rank * width)
    return {"greedy": out.greedy_tokens.tolist(), "gathered": out.gather()}


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_greedy_equals_the_argmax_of_the_gathered_logits(world):
    expected = full_logits().argmax(-1).tolist()
    assert expected[1] == 5 and expected[2] == 29 and expected[3] == 0
    for rank, r in enumerate(run_distributed(_greedy_on_rank, world_size=world, timeout_s=60)):
        assert r["greedy"] == expected, rank
        assert torch.equal(r["gathered"], full_logits()), rank


def _too_large(rank: int, world: int) -> str:
    try:
        sharded_logits(torch.randn(1, 2 ** 23 + 1), rank * (2 ** 23 + 1))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_vocabulary_past_fp32_ids_is_refused_on_every_rank():
    for message in run_distributed(_too_large, world_size=2, timeout_s=60):
        assert "16777218 ids does not fit the fp32 token ids" in message, message


def test_single_rank_needs_no_group_but_the_tp1_one():
    results = run_distributed(_greedy_on_rank, world_size=1, timeout_s=60)
    assert results[0]["greedy"] == full_logits().argmax(-1).tolist()


@pytest.mark.parametrize("width", [1, 7, 96, 256, 1000, 64128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_level_row_max_is_the_first_maximum(width, dtype):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=g).to(dtype)
    x[1] = x[1].round()  # many ties
    if width > 3:
        x[2, [width - 1, 3]] = x[2].max() + 1
    best, index = _row_max(x)
    assert index.tolist() == x.argmax(-1).tolist()
    assert torch.equal(best, x.max(-1).values)
