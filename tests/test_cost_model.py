"""The built-in rule (`fusion.dispatch.cost_model`): against the packaged measurements, against measured
shapes no table holds, and its reach (world sizes it has no model for)."""
import json

import pytest
import torch
from arfusion.fusion.dispatch.cost_model import (
    COEFFICIENTS,
    cheapest,
    predicted_us,
    rule_picks,
)
from arfusion.fusion.dispatch.table import PACKAGED_TABLE
from arfusion.fusion.strategy import Strategy as S

from tests.fake_backends import UNLIMITED, flashinfer_backends, make_dispatcher

ALL = tuple(S)


def test_the_rule_picks_the_measured_fastest_at_every_packaged_size():
    worst = 1.0
    for entry in json.loads(PACKAGED_TABLE.read_text())["entries"]:
        if (entry["gpu"], entry["world_size"], entry["dtype"]) != ("NVIDIA H200", 2, "bfloat16"):
            continue
        for tokens, row in entry["timings_us"].items():
            picked = cheapest([S(s) for s in row], int(tokens), entry["hidden"], torch.bfloat16, 2)
            worst = min(worst, min(row.values()) / row[picked.value])
    assert worst >= 0.95


# (hidden, tokens) -> the fastest strategy measured on 2 x H200 (bf16, TP2), at sizes no table held
MEASURED_ELSEWHERE = {(2880, 2048): S.SYMM_MEM_FUSED, (2048, 2048): S.SYMM_MEM_FUSED, (896, 2048): S.SYMM_MEM_FUSED,
                      (896, 1): S.FLASHINFER_ONE_SHOT, (2880, 4096): S.SYMM_MEM_FUSED, (3584, 4096): S.SYMM_MEM_FUSED,
                      (3584, 1024): S.SYMM_MEM_FUSED}


@pytest.mark.parametrize("hidden,tokens", sorted(MEASURED_ELSEWHERE))
def test_the_rule_finds_the_fastest_strategy_off_the_table(hidden, tokens):
    runnable = [s for s in ALL if s != S.TORCH and not (s == S.FLASHINFER_TWO_SHOT and tokens <= 2)]
    assert cheapest(runnable, tokens, hidden, torch.bfloat16, 2) == MEASURED_ELSEWHERE[(hidden, tokens)]


def test_costs_grow_with_the_message():
    for s in COEFFICIENTS[2]:  # every strategy whose class declares a TP2 cost
        costs = [predicted_us(s, t, 4096, torch.bfloat16, 2) for t in (1, 64, 1024, 8192)]
        assert costs == sorted(costs) and costs[0] > 0


def test_unmodelled_world_sizes_get_no_pick_and_no_buffers():
    assert cheapest(ALL, 8, 4096, torch.bfloat16, 8) is None
    assert rule_picks(8192, 4096, torch.bfloat16, 8) == set()
    assert rule_picks(8192, 4096, torch.bfloat16, 2) == {S.FLASHINFER_ONE_SHOT, S.SYMM_MEM_FUSED}


def test_dispatcher_uses_the_rule_without_a_table_and_respects_a_one_shot_limit():
    d = make_dispatcher(flashinfer_backends(max_tokens=4096, symm_mem_fused=UNLIMITED), hidden=2880)
    assert d.strategy(0, 1) == S.FLASHINFER_ONE_SHOT
    assert d.strategy(0, 2048) == S.SYMM_MEM_FUSED
    capped = make_dispatcher(flashinfer_backends(max_tokens=4096), hidden=2880, one_shot_max_input_bytes=1024)
    assert capped.strategy(0, 16) != S.FLASHINFER_ONE_SHOT
