"""The public op's strategies that run on any device (nccl, torch) against the reference
composition, 2 ranks over gloo; its input checks and the flashinfer workspace checks."""
import pytest
import torch
from arfusion.fusion import (
    AllReduceFusionWorkspace,
    FusionInputError,
    FusionUnsupportedError,
    Quant,
    Strategy,
    TensorParallelGroup,
    all_reduce_add_rms_norm,
    reference,
)
from arfusion.layers.parallel_state import get_tp_group

from tests.dist_utils import AllReduceCounter, run_distributed
from tests.tolerances import assert_close

EPS = 1e-6


def rank_inputs(rank: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """This rank's partial sum, and the residual and weight every rank shares (random, never zeros)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    shared = torch.Generator().manual_seed(seed * 1000 + 999)
    residual = torch.randn(tokens, hidden, generator=shared).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=shared)).to(dtype)
    return x, residual, weight


def _backends_match_reference(rank, world_size, dtype, with_residual):
    group = get_tp_group()
    counter = AllReduceCounter(group)
    results = {}
    for tokens, hidden in [(1, 64), (7, 128), (33, 96)]:
        x, residual, weight = rank_inputs(rank, tokens, hidden, dtype, seed=tokens)
        full = sum(rank_inputs(r, tokens, hidden, dtype, seed=tokens)[0].float() for r in range(world_size)).to(dtype)
        res = residual if with_residual else None
        expected = reference.add_rms_norm(full, res, weight, EPS)
        for strategy in (Strategy.TORCH, Strategy.NCCL):
            before = counter.total
            normed, residual_out, _ = all_reduce_add_rms_norm(
                x.clone(), None if res is None else res.clone(), weight, EPS, group=group, strategy=strategy
            )
            assert counter.total == before + 1, "exactly one reduction per call"
            assert_close(normed, expected[0])
            assert_close(residual_out, expected[1])
            if strategy is Strategy.TORCH:  # its one-call path is the reference's ops on the group's sum: same bits
                reduced = group.all_reduce(x.clone())
                exact = reference.add_rms_norm(reduced, res, weight, EPS)
                assert torch.equal(normed, exact[0]) and torch.equal(residual_out, exact[1])
            results[(tokens, hidden, strategy.value)] = normed.float().sum().item()
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_torch_fused_equals_unfused_reference(dtype, with_residual):
    per_rank = run_distributed(_backends_match_reference, args=(dtype, with_residual))
    assert per_rank[0] == per_rank[1], "both ranks must produce the same normalised output"


def _bad_inputs(rank, world_size):
    group = get_tp_group()
    counter = AllReduceCounter(group)
    x, residual, weight = rank_inputs(rank, 8, 64, torch.float32)
    cases = {
        "non-contiguous": (x.t().contiguous().t(), residual, weight),
        "residual dtype": (x, residual.double(), weight),
        "hidden mismatch": (x, residual, weight[:32]),
        "1-D input": (x[0], None, weight),
        "int dtype": (x.long(), None, weight.long()),
        "residual shape": (x, residual[:4], weight),
    }
    messages = {}
    for name, (xi, ri, wi) in cases.items():
        with pytest.raises(FusionInputError) as err:
            all_reduce_add_rms_norm(xi, ri, wi, EPS, group=group, strategy=Strategy.TORCH)
        messages[name] = str(err.value)
    assert counter.total == 0, "a rejected input must not start a collective"
    return messages


def test_bad_inputs_raise_named_errors_without_collectives():
    messages = run_distributed(_bad_inputs)[0]
    assert "contiguous" in messages["non-contiguous"]
    assert "dtype" in messages["residual dtype"]
    assert "hidden" in messages["hidden mismatch"]
    assert "2-D" in messages["1-D input"]
    assert "not supported" in messages["int dtype"]
    assert "shape" in messages["residual shape"]


class _FakeHandle:
    def destroy(self) -> None:
        pass


def _workspace(max_tokens: int = 16, hidden: int = 128, dtype: torch.dtype = torch.bfloat16) -> AllReduceFusionWorkspace:
    ws = AllReduceFusionWorkspace(TensorParallelGroup(0, 1, torch.device("cpu")), lambda *a: _FakeHandle())
    assert ws.ensure(max_tokens, hidden, dtype)
    return ws


@pytest.mark.parametrize(
    "strategy,tokens,hidden,dtype,needle",
    [(Strategy.FLASHINFER_ONE_SHOT, 17, 128, torch.bfloat16, "cannot take"),
     (Strategy.FLASHINFER_ONE_SHOT, 4, 100, torch.bfloat16, "multiple of 16"),
     (Strategy.FLASHINFER_ONE_SHOT, 4, 128, torch.float16, "cannot take"),
     (Strategy.FLASHINFER_TWO_SHOT, 1, 128, torch.bfloat16, "cannot take"),
     (Strategy.SYMM_MEM_FUSED, 4, 128, torch.bfloat16, "AllReduceFusion.run")],
)
def test_kernel_shape_checks_name_the_problem(strategy, tokens, hidden, dtype, needle):
    x, residual, weight = (torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype),
                           torch.rand(hidden).to(dtype) + 0.5)
    ws = _workspace()
    with pytest.raises(FusionInputError, match=needle):
        all_reduce_add_rms_norm(x, residual, weight, EPS, group=ws.group, strategy=strategy, workspace=ws)


def test_kernel_shape_check_without_workspace():
    x = torch.randn(2, 128).bfloat16()
    with pytest.raises(FusionInputError, match="no fusion workspace"):
        all_reduce_add_rms_norm(x, None, torch.ones(128).bfloat16(), EPS, group=TensorParallelGroup(0, 1, x.device),
                                strategy=Strategy.FLASHINFER_ONE_SHOT)

def test_reference_fp8_quantization_clamps_and_scales():
    normed = torch.tensor([[0.5, -1000.0, 3.0, 2000.0]])
    q = reference.quantize_fp8_static(normed, torch.tensor([2.0]))
    assert q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(q.float(), torch.tensor([[0.25, -448.0, 1.5, 448.0]]))


def _quantized_and_refused(rank, world_size):
    group = get_tp_group()
    x, residual, weight = rank_inputs(rank, 4, 64, torch.float32, seed=3)
    full = sum(rank_inputs(r, 4, 64, torch.float32, seed=3)[0] for r in range(world_size))
    scale = torch.tensor([0.5])
    out = all_reduce_add_rms_norm(x.clone(), residual.clone(), weight, EPS, group=group, strategy=Strategy.NCCL,
                                  quant=Quant("fp8", scale))
    expected = reference.quantize_fp8_static(reference.add_rms_norm(full, residual, weight, EPS)[0], scale)
    assert out.normed.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(out.normed.float(), expected.float(), atol=0.0, rtol=0.0)
    refusals = {}
    for name, call in {
        "fp4": lambda: all_reduce_add_rms_norm(x.clone(), residual.clone(), weight, EPS, group=group,
                                               strategy=Strategy.TORCH, quant=Quant("fp4", scale)),
        "symm": lambda: all_reduce_add_rms_norm(x.clone(), residual.clone(), weight, EPS, group=group,
                                                strategy=Strategy.SYMM_MEM_FUSED),
        "workspace": lambda: all_reduce_add_rms_norm(x.clone(), residual.clone(), weight, EPS, group=group,
                                                     strategy=Strategy.FLASHINFER_ONE_SHOT),
    }.items():
        with pytest.raises((FusionInputError, FusionUnsupportedError)) as err:
            call()
        refusals[name] = str(err.value)
    return refusals


def test_fp8_output_matches_the_reference_and_unsupported_requests_are_refused():
    refusals = run_distributed(_quantized_and_refused)[0]
    assert "FP4" in refusals["fp4"] and "sm100" in refusals["fp4"]
    assert "AllReduceFusion.run" in refusals["symm"]
    assert "no fusion workspace" in refusals["workspace"]


def test_quant_rejects_a_bad_scale_or_kind():
    with pytest.raises(FusionInputError, match="one-element float32"):
        Quant("fp8", torch.tensor([1.0, 2.0]))
    with pytest.raises(FusionInputError, match="'fp8' or 'fp4'"):
        Quant("int4", torch.tensor([1.0]))
