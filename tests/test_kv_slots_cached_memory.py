"""`engine.runtime.rank_parts.kv_slots` on a GPU sizes the KV cache from the memory the caching
allocator does not hold: blocks it kept from the load's freed temporaries (a full tensor drawn or
read before a rank's share is copied out) are handed back (``torch.cuda.empty_cache``) before
``mem_get_info`` measures, on every rank before any of them measures when ranks share a GPU.
No GPU: ``torch.cuda`` is replaced by a model of one device whose cache holds ``CACHED`` bytes
until emptied."""
import logging
from types import SimpleNamespace

import pytest
import torch

from arfusion.engine.models.forward_batch import KVCache
from arfusion.engine.runtime import rank_parts
from arfusion.engine.runtime.model_runner import RunnerSettings

GIB = 2 ** 30
TOTAL, USED, CACHED = 80 * GIB, 60 * GIB, 5 * GIB  # the weights in use, the load's leftovers cached


class FakeDevice:
    """One GPU's memory as mem_get_info reports it, and the order of the calls."""

    def __init__(self) -> None:
        self.cached = CACHED
        self.calls: list[str] = []

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return TOTAL - USED - self.cached, TOTAL


class FakeGroup:
    def __init__(self, device: FakeDevice, sharers: int) -> None:
        self.rank, self.device = 0, torch.device("cuda", 0)
        self.ranks_on_this_gpu, self.shares_gpu = sharers, sharers > 1
        self.fake = device

    def all_agree(self, ok: bool) -> bool:
        self.fake.calls.append("all_agree")
        return ok

    def all_gather_object(self, obj):
        return [obj] * self.ranks_on_this_gpu


def _loaded() -> SimpleNamespace:
    config = SimpleNamespace(num_hidden_layers=36, head_dim=64)
    return SimpleNamespace(config=config, dtype=torch.bfloat16, context_len=131072,
                           model=SimpleNamespace(num_kv_heads_local=8))


@pytest.mark.parametrize("sharers", [1, 2])
def test_the_cached_blocks_of_the_load_go_to_the_kv_cache(monkeypatch, caplog, sharers):
    caplog.set_level(logging.INFO, logger=rank_parts.__name__)
    fake = FakeDevice()
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    settings = RunnerSettings(mem_fraction_static=0.85, max_running_requests=256)
    slots, _ = rank_parts.kv_slots(settings, FakeGroup(fake, sharers), _loaded(), settings.max_running_requests)
    per_slot = KVCache.bytes_per_slot(36, 8, 64, torch.bfloat16)
    assert slots == int((TOTAL * 0.85 - USED) / sharers // per_slot)  # the cached 5 GiB counted as free
    assert slots > 2 * int((TOTAL * 0.85 - USED - CACHED) / sharers // per_slot)  # 8 GiB rather than 3
    expected = ["empty_cache", "all_agree", "mem_get_info"] if sharers > 1 else ["empty_cache", "mem_get_info"]
    assert fake.calls == expected, "every rank empties its cache before any measures"
    assert f"KV cache: {slots} token slots" in caplog.text and "GiB free of 80.0 GiB" in caplog.text
