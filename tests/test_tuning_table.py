"""Measured strategy tables: loading, matching, fallback, rank agreement, symmetric memory skip."""
import json
import logging

import pytest
import torch

from arfusion.fusion.backends.symm_mem import SymmMemTwoShotBackend
from arfusion.fusion.backends.symmetric_buffer import symm_mem_unavailable_reason
from arfusion.fusion.dispatch.table import StrategyTable, TuningTableError, parse_table, read_table, select_table
from arfusion.fusion.strategy import Strategy as S
from arfusion.layers.parallel_state import get_tp_group
from tests.dist_utils import make_fusion, run_distributed
from tests.fake_backends import UNLIMITED, flashinfer_backends, make_dispatcher

TIMINGS = {
    "1": {"nccl": 8.7, "flashinfer_one_shot": 4.5},
    "128": {"nccl": 16.1, "flashinfer_one_shot": 7.4, "flashinfer_two_shot": 13.7, "symm_mem_two_shot": 10.2},
    "1024": {"nccl": 53.4, "flashinfer_one_shot": 42.3, "symm_mem_two_shot": 38.0},
    "4096": {"nccl": 168.0, "flashinfer_one_shot": 165.0, "symm_mem_two_shot": 125.0, "symm_mem_fused": 120.0},
}
DOC = {"version": 2, "entries": [{"gpu": "cpu", "world_size": 2, "hidden": 64, "dtype": "float32", "timings_us": TIMINGS}]}


def table() -> StrategyTable:
    return select_table(parse_table(DOC), "cpu", 2, 64, "float32")


def test_lookup_uses_the_smallest_bucket_at_or_above_the_batch():
    t = table()
    everything = list(tuple(S))
    assert t.fastest(1, everything) == S.FLASHINFER_ONE_SHOT
    assert t.fastest(100, everything) == S.FLASHINFER_ONE_SHOT  # bucket 128
    assert t.fastest(129, everything) == S.SYMM_MEM_TWO_SHOT  # bucket 1024
    assert t.fastest(100000, everything) == S.SYMM_MEM_FUSED  # beyond: the largest bucket


def test_lookup_skips_strategies_that_cannot_run_here():
    assert table().fastest(4096, [S.NCCL, S.FLASHINFER_ONE_SHOT]) == S.FLASHINFER_ONE_SHOT
    assert table().fastest(4096, [S.TORCH]) is None


def test_no_matching_entry_selects_nothing():
    entries = parse_table(DOC)
    assert select_table(entries, "NVIDIA H200", 2, 64, "float32") is None
    assert select_table(entries, "cpu", 4, 64, "float32") is None
    assert select_table(None, "cpu", 2, 64, "float32") is None


@pytest.mark.parametrize("doc,needle", [
    ({"entries": []}, "version"),
    ({"version": 2, "entries": {}}, "list"),
    ({"version": 2, "entries": [{"gpu": "x", "world_size": "2", "hidden": 1, "dtype": "bf16", "timings_us": {}}]}, "world_size"),
    ({"version": 2, "entries": [{**DOC["entries"][0], "timings_us": {"abc": {}}}]}, "bucket"),
    ({"version": 2, "entries": [{**DOC["entries"][0], "timings_us": {"8": {"magic": 1.0}}}]}, "magic"),
    ({"version": 2, "entries": [{**DOC["entries"][0], "timings_us": {"8": {"nccl": -1}}}]}, "nccl"),
])
def test_bad_tables_are_named(doc, needle):
    with pytest.raises(TuningTableError, match=needle):
        parse_table(doc)


def test_missing_or_corrupt_file_warns_and_falls_back(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    assert read_table(tmp_path / "none.json") is None
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    assert read_table(corrupt) is None
    assert "not found" in caplog.text and "unusable" in caplog.text


def test_dispatcher_follows_the_table_and_falls_back_without_one():
    def dispatcher(table_=table(), **more):
        return make_dispatcher(flashinfer_backends(max_tokens=4096, **more), hidden=64, dtype=torch.float32,
                               table=table_)

    d = dispatcher(symm_mem_two_shot=4096)
    assert [d.strategy(0, t) for t in (1, 128, 1024, 4096)] == [
        S.FLASHINFER_ONE_SHOT, S.FLASHINFER_ONE_SHOT, S.SYMM_MEM_TWO_SHOT, S.SYMM_MEM_TWO_SHOT]
    assert dispatcher().strategy(0, 4096) == S.FLASHINFER_ONE_SHOT, "symm-mem unavailable: next fastest"
    fused = dispatcher(symm_mem_two_shot=4096, symm_mem_fused=UNLIMITED)
    assert [fused.strategy(0, t) for t in (1024, 4096)] == [S.SYMM_MEM_TWO_SHOT, S.SYMM_MEM_FUSED]
    chunked = dispatcher(symm_mem_fused=UNLIMITED)
    assert chunked.strategy(0, 100000) == S.SYMM_MEM_FUSED, "beyond the table: its largest bucket"
    builtin = dispatcher(None, symm_mem_fused=UNLIMITED)
    assert builtin.strategy(0, 1) == S.FLASHINFER_ONE_SHOT  # the built-in rule (fusion.dispatch.cost_model)
    assert builtin.strategy(0, 65536) == S.SYMM_MEM_FUSED
    off = make_dispatcher(flashinfer_backends(), table=table(), off_reason="deterministic mode")
    assert off.strategy(0, 1024) == S.NCCL


class _FakeWorkspace:
    def destroy(self) -> None:
        pass


def _table_on_every_rank(rank, world_size, path):
    import arfusion.fusion.backends.flashinfer as fi
    import arfusion.fusion.backends.flashinfer_workspace as ws

    fi.flashinfer_unavailable_reason = lambda *a: None  # pretend: flashinfer on an sm90 GPU, fake workspace
    ws.create_flashinfer_workspace = lambda *a: _FakeWorkspace()
    ws._preflight = lambda *a: None
    fusion = make_fusion(64, torch.float32, enabled=True, backend="flashinfer", max_tokens=4096, table_path=path)
    group = get_tp_group()
    symm = fusion.backends[S.SYMM_MEM_TWO_SHOT]
    return {
        "strategies": [fusion.strategy(0, t) for t in (1, 64, 128, 512, 1024, 4096)],
        "symm_ready": symm.fits(1),
        "symm_reason": symm_mem_unavailable_reason(group.device),
        "symm_failure": symm.failure,
    }


def test_rank_zeros_table_reaches_every_rank_and_symm_mem_skips_cleanly_on_cpu(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(DOC))
    r0, r1 = run_distributed(_table_on_every_rank, args=(str(path),))
    assert r0["strategies"] == r1["strategies"]
    # symm_mem is measured fastest at 1024+ but cannot run on CPU: the next fastest measured wins
    assert r0["strategies"] == [S.FLASHINFER_ONE_SHOT] * 4 + [S.FLASHINFER_ONE_SHOT, S.FLASHINFER_ONE_SHOT]
    assert not r0["symm_ready"] and not r1["symm_ready"]
    assert "CUDA device" in r0["symm_reason"] and "rank 1" in r0["symm_failure"]


def _symm_on_cpu(rank, world_size):
    s = SymmMemTwoShotBackend(get_tp_group())
    return s.ensure(16, 64, torch.float32), s.fits(4)


def test_symm_mem_strategy_is_refused_together_on_cpu():
    assert run_distributed(_symm_on_cpu) == [(False, False), (False, False)]
