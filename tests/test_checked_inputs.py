"""The fusion op's input checks (`fusion.validation.CheckedInputs`): the full check once per
forward, and every bad input still refused with an error naming it once the residual and the
weight are trusted (the op's inline test, then the full check)."""
import pytest
import torch

from arfusion.fusion import AllReduceFusion, FusionConfig, FusionInputError, PartialSum, Strategy
from arfusion.fusion.group import TensorParallelGroup


def _op() -> AllReduceFusion:
    """A TP1 op (fusion off: its unfused path) with a torch backend for deferred reductions."""
    op = AllReduceFusion(TensorParallelGroup(0, 1, torch.device("cpu")), FusionConfig(backend="torch"), 64,
                         torch.float32)
    op.setup()
    op.backends[Strategy.TORCH].ensure(64, 64, torch.float32)
    return op


def _trusted():
    """An op whose residual (from its last reduction) and weight are trusted."""
    op = _op()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=g)
    _, residual = op.add_rms_norm(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g), weight, 1e-6)
    assert op._inputs.residual is residual and op._inputs.weights[id(weight)] is weight
    return op, residual, weight


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("bad, match", [
    (lambda: torch.randn(4, 32), "residual shape"),
    (lambda: torch.randn(4, 64).to(torch.float16), "dtype"),
    (lambda: torch.randn(64, 4).t(), "contiguous"),
    (lambda: torch.randn(3, 64), "residual shape"),
])
def test_a_bad_input_against_a_trusted_residual_is_named(bad, match, deferred):
    op, residual, weight = _trusted()
    x = bad()
    with pytest.raises(FusionInputError, match=match):
        op.add_rms_norm(PartialSum(pending=x, layer_id=0, strategy=Strategy.TORCH) if deferred else x, residual,
                        weight, 1e-6)


def test_a_replaced_weight_is_checked_again():
    op, residual, _ = _trusted()
    with pytest.raises(FusionInputError, match="norm weight shape"):
        op.add_rms_norm(torch.randn(4, 64), residual, torch.randn(32), 1e-6)


def test_a_residual_the_op_did_not_return_takes_the_full_check():
    op, _, weight = _trusted()
    with pytest.raises(FusionInputError, match="2-D"):
        op.add_rms_norm(torch.randn(2, 4, 64), torch.randn(2, 4, 64), weight, 1e-6)


def test_trusted_inputs_chain_and_destroy_drops_the_trust():
    op, residual, weight = _trusted()
    _, residual_out = op.add_rms_norm(torch.randn(4, 64), residual, weight, 1e-6)
    assert op._inputs.residual is residual_out
    op.destroy()
    assert op._inputs.residual is None and not op._inputs.weights
