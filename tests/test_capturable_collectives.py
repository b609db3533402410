"""The group's capturable stand-in for its collectives (ranks sharing a GPU: `fusion.capturable`),
its selection logic on CPU, 2 ranks over gloo: the group routes a tensor to the stand-in only
when one is set and holds it, else to the device group; the greedy tokens' all-gather
(`layers.sharded_logits`) goes through the group; making the stand-in is voted (refused on
every rank off CUDA, with the reason) and a group keeps the one it has."""
from __future__ import annotations

import torch
import torch.distributed as dist

from arfusion.fusion import disable_capturable_collectives, enable_capturable_collectives
from arfusion.layers.parallel_state import get_tp_group
from tests.dist_utils import run_distributed


class CountingStandIn:
    """Holds tensors of at most ``capacity`` bytes; reduces and gathers over the device group, counting calls."""

    def __init__(self, group, capacity: int) -> None:
        self.group, self.capacity, self.calls = group, capacity, []

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.capacity

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_reduce", tuple(x.shape)))
        dist.all_reduce(x, group=self.group.device_group)
        return x

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_gather", tuple(x.shape)))
        dist.all_gather_into_tensor(out, x, group=self.group.device_group)
        return out


def _routing(rank, world):
    from arfusion.layers.sharded_logits import sharded_logits

    group = get_tp_group()
    refused = enable_capturable_collectives(group, 1 << 20)  # CPU tensors: no symmetric memory
    out = {"refused": refused, "none_after_refusal": group.capturable is None}
    stand_in = CountingStandIn(group, capacity=64 * 4)
    group.capturable = stand_in
    small, large = torch.full((8, 8), rank + 1.0), torch.full((16, 16), rank + 1.0)  # 256 and 1024 bytes
    out["small_sum"] = group.all_reduce(small)[0, 0].item()
    out["large_sum"] = group.all_reduce(large)[0, 0].item()
    gathered = group.all_gather_into(torch.empty(2 * 4, 2), torch.full((4, 2), float(rank)))
    out["gathered"] = gathered[:, 0].tolist()
    g = torch.Generator().manual_seed(rank)
    logits = sharded_logits(torch.randn(3, 5, generator=g), vocab_start=5 * rank)
    out["tokens"] = logits.greedy_tokens.tolist()
    out["calls"] = list(stand_in.calls)
    out["keeps_larger"] = enable_capturable_collectives(group, 64 * 4)
    out["refuses_smaller"] = enable_capturable_collectives(group, 64 * 4 + 1)
    disable_capturable_collectives(group)
    out["disabled"] = group.capturable is None
    return out


def test_group_routes_to_the_stand_in_only_what_it_holds():
    per_rank = run_distributed(_routing, world_size=2)
    for out in per_rank:
        assert out["refused"] and "CUDA" in out["refused"] and out["none_after_refusal"], out["refused"]
        assert out["small_sum"] == 3.0 and out["large_sum"] == 3.0
        assert out["gathered"] == [0.0] * 4 + [1.0] * 4
        assert out["calls"] == [("all_reduce", (8, 8)), ("all_gather", (4, 2)), ("all_gather", (3, 2))], out["calls"]
        assert out["keeps_larger"] is None and "earlier model" in out["refuses_smaller"]
        assert out["disabled"]
    assert per_rank[0]["refused"] == per_rank[1]["refused"], "voted: every rank names every rank's reason"
    logits = [torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    assert per_rank[0]["tokens"] == torch.cat(logits, dim=-1).argmax(-1).tolist() == per_rank[1]["tokens"]


def test_one_rank_needs_no_stand_in():
    from arfusion.fusion import TensorParallelGroup

    group = TensorParallelGroup(0, 1, torch.device("cpu"))
    assert enable_capturable_collectives(group, 1024) is None and group.capturable is None
