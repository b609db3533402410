"""The fusion op's input checks (`fusion.validation.CheckedInputs`): the full check once per
forward, and every bad input still refused with an error naming it once the residual and the
weight are trusted (the op's inline test, then the full check)."""
import pytest
import torch
from arfusion.fusion import AllReduceFusion, FusionConfig, FusionInputError, PartialSum
from arfusion.fusion.group import TensorParallelGroup


def _op() -> AllReduceFusion:
    """A TP1 op (fusion off: every reduction by NCCL, reduce then norm)."""
    op = AllReduceFusion(TensorParallelGroup(0, 1, torch.device("cpu")), FusionConfig(backend="torch"), 64,
                         torch.float32)
    op.setup()
    return op


def _reduce(op: AllReduceFusion, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    return op.reduce_add_rms_norm(PartialSum(pending=x, layer_id=0, op=op), residual, weight, 1e-6)


def _trusted():
    """An op whose residual (from its last reduction) and weight are trusted."""
    op = _op()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=g)
    _, residual = _reduce(op, torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g), weight)
    assert op._inputs.residual is residual and op._inputs.weights[id(weight)] is weight
    return op, residual, weight


@pytest.mark.parametrize("bad, match", [
    (lambda: torch.randn(4, 32), "residual shape"),
    (lambda: torch.randn(4, 64).to(torch.float16), "dtype"),
    (lambda: torch.randn(64, 4).t(), "contiguous"),
    (lambda: torch.randn(3, 64), "residual shape"),
])
def test_a_bad_input_against_a_trusted_residual_is_named(bad, match):
    op, residual, weight = _trusted()
    with pytest.raises(FusionInputError, match=match):
        _reduce(op, bad(), residual, weight)


def test_a_replaced_weight_is_checked_again():
    op, residual, _ = _trusted()
    with pytest.raises(FusionInputError, match="norm weight shape"):
        _reduce(op, torch.randn(4, 64), residual, torch.randn(32))


def test_a_residual_the_op_did_not_return_takes_the_full_check():
    op, _, weight = _trusted()
    with pytest.raises(FusionInputError, match="2-D"):
        _reduce(op, torch.randn(2, 4, 64), torch.randn(2, 4, 64), weight)


def test_trusted_inputs_chain_and_destroy_drops_the_trust():
    op, residual, weight = _trusted()
    _, residual_out = _reduce(op, torch.randn(4, 64), residual, weight)
    assert op._inputs.residual is residual_out
    op.destroy()
    assert op._inputs.residual is None and not op._inputs.weights


def _fused_path_refusals(rank: int, world_size: int) -> dict[str, str]:
    """TP2, the torch strategy's one-call path: every bad input is named before any collective."""
    from arfusion.fusion import Strategy
    from arfusion.layers.parallel_state import get_tp_group

    from tests.dist_utils import AllReduceCounter, make_fusion

    op = make_fusion(64, enabled=True, backend="torch", max_tokens=8)
    g = torch.Generator().manual_seed(rank)
    weight = torch.randn(64, generator=torch.Generator().manual_seed(7))
    _, residual = _reduce(op, torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g), weight)
    assert op.strategy(0, 4) is Strategy.TORCH and op._inputs.residual is residual
    counter = AllReduceCounter(get_tp_group())
    bad = {"dtype": torch.randn(4, 64).to(torch.float16), "shape": torch.randn(4, 32),
           "contiguous": torch.randn(64, 4).t(), "int": torch.randint(0, 9, (4, 64))}
    messages = {}
    for name, x in bad.items():
        with pytest.raises(FusionInputError) as err:
            _reduce(op, x, residual, weight)
        messages[name] = str(err.value)
    with pytest.raises(FusionInputError) as err:  # more tokens than the torch backend was made for
        op.run(Strategy.TORCH, torch.randn(9, 64), None, weight, 1e-6)
    messages["tokens"] = str(err.value)
    assert counter.total == 0, "a refused input starts no collective"
    assert op.strategy(0, 9) is not Strategy.TORCH, "a batch beyond the limit falls back, reduced unfused"
    return messages


def test_the_fused_path_names_every_bad_input_before_any_collective():
    from tests.dist_utils import run_distributed

    for messages in run_distributed(_fused_path_refusals):
        assert "dtype" in messages["dtype"] and "shape" in messages["shape"]
        assert "contiguous" in messages["contiguous"] and "dtype" in messages["int"]
        assert "cannot run 9 tokens" in messages["tokens"]
