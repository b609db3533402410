"""The fused op's backends against the reference composition, 2 ranks over gloo."""
import pytest
import torch

from fusion import FusionInputError, allreduce_residual_rmsnorm, reference
from fusion.flashinfer_ops import _check_kernel_shape
from layers.parallel_state import get_tp_group
from tests.dist_utils import run_distributed
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
    results = {}
    for tokens, hidden in [(1, 64), (7, 128), (33, 96)]:
        x, residual, weight = rank_inputs(rank, tokens, hidden, dtype, seed=tokens)
        full = sum(rank_inputs(r, tokens, hidden, dtype, seed=tokens)[0].float() for r in range(world_size)).to(dtype)
        res = residual if with_residual else None
        expected = reference.add_rms_norm(full, res, weight, EPS)
        for backend in ("torch", "unfused"):
            before = group.counters.total
            normed, residual_out = allreduce_residual_rmsnorm(
                x.clone(), None if res is None else res.clone(), weight, EPS, group=group, backend=backend
            )
            assert group.counters.total == before + 1, "exactly one reduction per call"
            assert_close(normed, expected[0])
            assert_close(residual_out, expected[1])
            results[(tokens, hidden, backend)] = normed.float().sum().item()
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_torch_fused_equals_unfused_reference(dtype, with_residual):
    per_rank = run_distributed(_backends_match_reference, args=(dtype, with_residual))
    assert per_rank[0] == per_rank[1], "both ranks must produce the same normalised output"


def _bad_inputs(rank, world_size):
    group = get_tp_group()
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
            allreduce_residual_rmsnorm(xi, ri, wi, EPS, group=group, backend="torch")
        messages[name] = str(err.value)
    assert group.counters.total == 0, "a rejected input must not start a collective"
    return messages


def test_bad_inputs_raise_named_errors_without_collectives():
    messages = run_distributed(_bad_inputs)[0]
    assert "contiguous" in messages["non-contiguous"]
    assert "dtype" in messages["residual dtype"]
    assert "hidden" in messages["hidden mismatch"]
    assert "2-D" in messages["1-D input"]
    assert "not supported" in messages["int dtype"]
    assert "shape" in messages["residual shape"]


class _FakeWorkspace:
    metadata = {"max_token_num": 16, "hidden_dim": 128, "use_fp32_lamport": False, "tp_size": 2}


@pytest.mark.parametrize(
    "tokens,hidden,dtype,needle",
    [(17, 128, torch.bfloat16, "exceed the workspace"), (4, 100, torch.bfloat16, "multiple of 16"),
     (4, 128, torch.float32, "does not match")],
)
def test_kernel_shape_checks_name_the_problem(tokens, hidden, dtype, needle):
    x = torch.randn(tokens, hidden).to(dtype)
    with pytest.raises(FusionInputError, match=needle):
        _check_kernel_shape(x, _FakeWorkspace(), world_size=2)


def test_kernel_shape_check_without_workspace():
    with pytest.raises(FusionInputError, match="no fusion workspace"):
        _check_kernel_shape(torch.randn(2, 128).bfloat16(), None, world_size=2)


def test_reference_fp8_quantization_clamps_and_scales():
    normed = torch.tensor([[0.5, -1000.0, 3.0, 2000.0]])
    q = reference.quantize_fp8_static(normed, torch.tensor([2.0]))
    assert q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(q.float(), torch.tensor([[0.25, -448.0, 1.5, 448.0]]))
