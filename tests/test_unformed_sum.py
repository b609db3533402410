"""A sum handed to the fusion op unformed (`fusion.UnformedSum`, a gpt-oss MoE layer's combine at
TP1): the op has it form itself inside the norm's launch when the residual and the weight are
the trusted ones at world size 1 outside deterministic mode, and materializes it everywhere else
(an untrusted residual, no residual, a launch that declines, deterministic mode,
`take_single_rank`, a pending norm), with the same results either way. The stand-in's sum is a
random tensor; its one-launch form is `fusion.reference.add_rms_norm` of it, so every path must
agree with the reference bit for bit (the same torch ops on the CPU)."""
from typing import Optional

import pytest
import torch

from arfusion.fusion import AllReduceFusion, FusionConfig, PartialSum, UnformedSum, reference
from arfusion.fusion.group import TensorParallelGroup

HIDDEN, EPS = 64, 1e-6


class StandIn(UnformedSum):
    """An `UnformedSum` of ``value``; records which form was asked for."""

    __slots__ = ("value", "shape", "dtype", "calls", "declines")

    def __init__(self, value: torch.Tensor, declines: bool = False) -> None:
        self.value, self.shape, self.dtype = value, value.shape, value.dtype
        self.calls: list[str] = []
        self.declines = declines

    def materialize(self) -> torch.Tensor:
        self.calls.append("materialize")
        return self.value.clone()

    def add_rms_norm(self, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        self.calls.append("add_rms_norm")
        return None if self.declines else reference.add_rms_norm(self.value, residual, weight, eps)


def _op(deterministic: bool = False) -> AllReduceFusion:
    op = AllReduceFusion(TensorParallelGroup(0, 1, torch.device("cpu")),
                         FusionConfig(backend="torch", deterministic=deterministic), HIDDEN, torch.float32)
    op.setup()
    return op


def _trusted(op: AllReduceFusion) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """The op's trusted residual and weight after one ordinary reduction."""
    g = torch.Generator().manual_seed(0)
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    _, residual = op.reduce_add_rms_norm(PartialSum(pending=torch.randn(3, HIDDEN, generator=g), layer_id=0, op=op),
                                         torch.randn(3, HIDDEN, generator=g), weight, EPS)
    return residual, weight, g


def _expected(value: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    return reference.add_rms_norm(value, residual.clone(), weight, EPS)


def test_trusted_inputs_form_the_sum_inside_the_norm():
    op = _op()
    residual, weight, g = _trusted(op)
    before = sum(op.counts.values())
    unformed = StandIn(torch.randn(3, HIDDEN, generator=g))
    expected = _expected(unformed.value, residual, weight)
    partial = PartialSum(pending=unformed, layer_id=1, op=op)
    assert "(3, 64) torch.float32" in repr(partial)
    normed, summed = op.reduce_add_rms_norm(partial, residual, weight, EPS)
    assert unformed.calls == ["add_rms_norm"]
    assert torch.equal(normed, expected[0]) and torch.equal(summed, expected[1])
    assert sum(op.counts.values()) == before + 1, "counted as the layer's reduction"
    assert op._inputs.residual is summed, "its sum is the next reduction's trusted residual"
    assert partial.pending is None


def _materialized(op: AllReduceFusion, unformed: StandIn, residual: Optional[torch.Tensor],
                  weight: torch.Tensor) -> None:
    expected = _expected(unformed.value, residual, weight) if residual is not None else None
    normed, summed = op.reduce_add_rms_norm(PartialSum(pending=unformed, layer_id=1, op=op), residual, weight, EPS)
    assert unformed.calls[-1] == "materialize"
    if expected is not None:
        torch.testing.assert_close(normed, expected[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(summed, expected[1], rtol=1e-6, atol=1e-6)


def test_every_other_case_materializes_the_sum():
    op = _op()
    residual, weight, g = _trusted(op)
    declining = StandIn(torch.randn(3, HIDDEN, generator=g), declines=True)
    _materialized(op, declining, residual, weight)
    assert declining.calls == ["add_rms_norm", "materialize"]
    untrusted = StandIn(torch.randn(3, HIDDEN, generator=g))
    _materialized(op, untrusted, torch.randn(3, HIDDEN, generator=g), weight)
    assert untrusted.calls == ["materialize"]
    no_residual = StandIn(torch.randn(3, HIDDEN, generator=g))
    _materialized(op, no_residual, None, weight)
    assert no_residual.calls == ["materialize"]
    deterministic = _op(deterministic=True)
    residual, weight, g = _trusted(deterministic)
    in_mode = StandIn(torch.randn(3, HIDDEN, generator=g))
    _materialized(deterministic, in_mode, residual, weight)
    assert in_mode.calls == ["materialize"]


def test_take_single_rank_and_a_pending_norm_get_the_tensor():
    from arfusion.layers.layernorm import RMSNorm
    from arfusion.layers.pending_norm import PendingNorm, defer

    op = _op()
    residual, weight, g = _trusted(op)
    unformed = StandIn(torch.randn(3, HIDDEN, generator=g))
    partial = PartialSum(pending=unformed, layer_id=1, op=op)
    x = op.take_single_rank(partial, residual, torch.empty_like(residual))
    assert unformed.calls == ["materialize"] and torch.equal(x, unformed.value) and partial.pending is None
    norm = RMSNorm(HIDDEN, EPS, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(weight)
    unformed = StandIn(torch.randn(3, HIDDEN, generator=g))
    pending = defer(norm, PartialSum(pending=unformed, layer_id=2, op=op), residual, lambda *a: None)
    assert isinstance(pending, PendingNorm) and unformed.calls == ["materialize"]
    assert torch.equal(pending.x, unformed.value)


def _layer_flags(rank: int, world: int, combine_into_norm: bool, preset: str = "gpt-oss-20b") -> list[bool]:
    import dataclasses

    from arfusion.engine.models.builtin import builtin_config
    from arfusion.engine.models.registry import build_model
    from tests.dist_utils import make_fusion

    base = builtin_config(preset)
    extra = {"layer_types": ("sliding_attention", "full_attention")} if preset.startswith("gpt-oss") else {}
    if base.num_experts:
        extra.update(moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    config = dataclasses.replace(base, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=128,
                                 combine_into_norm=combine_into_norm, **extra)
    model = build_model(config, make_fusion(config.hidden_size))
    return [layer.unformed_mlp for layer in model.model.layers]


def test_the_flag_reaches_the_layers_and_the_benchmark():
    """On by default (each gpt-oss layer at TP1 leaves its combine to the next norm), off with
    ``--disable-combine-into-norm``, through the server options, the runner and bench_one_batch."""
    from arfusion.engine import bench_one_batch
    from arfusion.engine.launch_config import runner_settings
    from arfusion.engine.models.builtin import builtin_config
    from arfusion.engine.runtime.model_runner import _run_form
    from arfusion.server_args import ServerArgs
    from tests.dist_utils import run_distributed

    default, disabled = runner_settings(ServerArgs()), runner_settings(ServerArgs.from_cli(["--disable-combine-into-norm"]))
    assert not default.disable_combine_into_norm and disabled.disable_combine_into_norm
    cpu = torch.device("cpu")
    assert _run_form(builtin_config("gpt-oss-20b"), default, cpu).combine_into_norm
    assert not _run_form(builtin_config("gpt-oss-20b"), disabled, cpu).combine_into_norm
    server, _ = bench_one_batch.parse_args(["--disable-combine-into-norm"])
    assert server.disable_combine_into_norm and "--disable-combine-into-norm" in bench_one_batch.build_parser().format_help()
    on, off = (run_distributed(_layer_flags, world_size=1, args=(flag,), timeout_s=120)[0] for flag in (True, False))
    assert on == [True, True] and off == [False, False]


@pytest.mark.parametrize("preset,expected", [("qwen3-30b-a3b", [True, True]), ("llama3-8b", [False, False])])
def test_qwen3_moe_layers_leave_their_combine_and_dense_ones_do_not(preset, expected):
    """A Qwen3-MoE layer at TP1 asks its experts for the unformed sum as gpt-oss's does (its grouped
    launches leave it: tests/test_fused_moe_unformed.py); a dense MLP has no combine to leave."""
    from tests.dist_utils import run_distributed

    flags = run_distributed(_layer_flags, world_size=1, args=(True, preset), timeout_s=120)[0]
    assert flags == expected
