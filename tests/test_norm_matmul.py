"""The residual add + RMSNorm + matmul launch (layers/kernels/triton_norm_matmul.py) under Triton's
CPU interpreter, in one spawned child with TRITON_INTERPRET=1 (skipped without triton), against
the torch reference: `fusion.reference.add_rms_norm`, then ``F.linear`` of its normed output in
fp32, rounded once (the launch's chain, its module docstring). fp32 and fp16 (the interpreter's
bf16 arithmetic is wrong, as tests/test_skinny_matmul.py notes: bf16 runs in
tests/gpu/test_norm_matmul_gpu.py); 1, 3 and 32 tokens; N a multiple of the output tile or not,
K a multiple of the K step or cut to its largest power of two (K 80: steps of 16), with and
without a bias, default and small tiles. Inputs: x, residual N(0, 1), norm weight 1 + N(0, 0.1),
W N(0, 1/K), bias N(0, 1).

Tolerances: fp32 rtol = atol = 1e-5 (`tests.tolerances`: the fp32 sums run in another order);
fp16 `tests.tolerances.SAME_ROUNDINGS` (two ulps: h and y are rounded where the reference
rounds them, and an element of h may sit one ulp from the reference's). The new residual equals
the reference's sum bit for bit; x and the old residual keep their bits; a given ``residual_out``
is the tensor returned. Bad inputs: a ValueError naming the problem, before any launch."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter
from tests.tolerances import SAME_ROUNDINGS, TOLERANCES

EPS = 1e-5
DTYPES = (torch.float32, torch.float16)
TOKENS = (1, 3, 32)
# (N, K, bias, tiles (block_n, block_k, warps, stages) or None for the default)
SHAPES = [(40, 64, True, (16, 32, 4, 2)), (96, 128, False, None), (33, 80, True, (32, 16, 2, 3)),
          (2050, 512, True, None)]
CASES = [(dtype, t, shape) for dtype in DTYPES for t in TOKENS for shape in SHAPES]


def _inputs(dtype: torch.dtype, t: int, n: int, k: int, bias: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(t, k, generator=g).to(dtype), "residual": torch.randn(t, k, generator=g).to(dtype),
            "norm_weight": (1 + 0.1 * torch.randn(k, generator=g)).to(dtype),
            "weight": (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype),
            "bias": torch.randn(n, generator=g).to(dtype) if bias else None}


def _reference(inp: dict) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.functional as F

    from arfusion.fusion import reference

    h, summed = reference.add_rms_norm(inp["x"], inp["residual"], inp["norm_weight"], EPS)
    bias = inp["bias"].float() if inp["bias"] is not None else None
    return F.linear(h.float(), inp["weight"].float(), bias).to(h.dtype), summed


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.kernels.triton_norm_matmul import norm_linear
    from arfusion.layers.kernels.triton_skinny_matmul import SkinnyConfig

    results = {}
    for seed, case in enumerate(CASES):
        dtype, t, (n, k, bias, tiles) = case
        inp = _inputs(dtype, t, n, k, bias, seed)
        before = {name: inp[name].clone() for name in ("x", "residual")}
        given = torch.empty_like(inp["x"]) if seed % 2 else None
        y, summed = norm_linear(inp["x"], inp["residual"], inp["norm_weight"], EPS, inp["weight"], inp["bias"],
                                given, SkinnyConfig(*tiles) if tiles else None)
        results[case] = {
            "out": (y, summed), "reference": _reference(inp),
            "inputs_kept": all(torch.equal(inp[name], before[name]) for name in before),
            "given_returned": given is None or summed is given,
        }
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


def _case_id(case) -> str:
    dtype, t, (n, k, bias, tiles) = case
    tiles_id = "default" if tiles is None else "x".join(map(str, tiles))
    return f"{str(dtype)[6:]}-t{t}-n{n}-k{k}{'-bias' if bias else ''}-{tiles_id}"


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_the_torch_reference(interpreted, case):
    result = interpreted[case]
    (y, summed), (y_ref, summed_ref) = result["out"], result["reference"]
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    rtol, atol = (TOLERANCES if y.dtype == torch.float32 else SAME_ROUNDINGS)[y.dtype]
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    assert torch.equal(summed, summed_ref), "the new residual is the reference's sum, bit for bit"
    assert result["inputs_kept"], "x and the old residual are only read"
    assert result["given_returned"]


def _bad(**changes) -> dict:
    inp = _inputs(torch.float16, 2, 48, 64, True, 0)
    inp.update(changes)
    return inp


@pytest.mark.parametrize("inp, match", [
    (_bad(x=torch.randn(2, 64, dtype=torch.float64), residual=torch.randn(2, 64, dtype=torch.float64)),
     "x must be fp16, bf16 or fp32"),
    (_bad(residual=torch.randn(2, 64).to(torch.bfloat16)), "residual must have x's dtype"),
    (_bad(weight=torch.randn(48, 64)), "weight must have x's dtype"),
    (_bad(residual=torch.randn(3, 64).half()), "residual must have x's shape"),
    (_bad(norm_weight=torch.ones(32).half()), r"norm weight must be \[64\]"),
    (_bad(weight=torch.randn(48, 32).half()), r"weight must be \[N, 64\]"),
    (_bad(bias=torch.randn(47).half()), r"bias must be \[48\]"),
    (_bad(x=torch.randn(33, 64).half(), residual=torch.randn(33, 64).half()), "takes 1 to 32 tokens, got 33"),
    (_bad(x=torch.randn(2, 40).half(), residual=torch.randn(2, 40).half(), norm_weight=torch.ones(40).half(),
          weight=torch.randn(48, 40).half()), r"K \(40\) must be a multiple of 16"),
    (_bad(x=torch.randn(64, 2).half().T), "contiguous last dimension"),
])
def test_bad_inputs_are_refused_by_name(inp, match):
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_norm_matmul import norm_linear

    with pytest.raises(ValueError, match=match):
        norm_linear(inp["x"], inp["residual"], inp["norm_weight"], EPS, inp["weight"], inp["bias"])


def test_residual_out_must_be_its_own_tensor_of_the_right_form():
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_norm_matmul import norm_linear

    inp = _bad()
    args = (inp["x"], inp["residual"], inp["norm_weight"], EPS, inp["weight"], inp["bias"])
    with pytest.raises(ValueError, match="not x or residual"):
        norm_linear(*args, residual_out=inp["residual"])
    with pytest.raises(ValueError, match="residual_out must be a contiguous"):
        norm_linear(*args, residual_out=torch.empty(2, 64))


def test_refusal_names_why_a_batch_keeps_the_separate_norm():
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_norm_matmul import refusal

    inp = _bad()
    assert "not on a CUDA device" in refusal(inp["x"], inp["residual"], inp["norm_weight"])
    reasons = {refusal(torch.randn(t, 64).half(), torch.randn(t, 64).half(), inp["norm_weight"]) for t in (33, 48, 512)}
    assert reasons == {"the launch takes at most 32 tokens"}, "one reason (logged once) for every larger batch"


@pytest.mark.parametrize("n, k", [(5120, 2048), (6144, 4096), (512, 256), (1152, 896), (2048, 2048), (5760, 2880)])
@pytest.mark.parametrize("tokens", [1, 32])
def test_the_k_step_divides_k_and_keeps_the_tiles_in_flight_within_the_budget(n, k, tokens):
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_norm_matmul import SMEM_BUDGET, k_step
    from arfusion.layers.kernels.triton_skinny_matmul import default_config

    cfg, block_m = default_config(n), max(16, 1 << (tokens - 1).bit_length())
    step = k_step(cfg, k, block_m, 2)
    assert k % step == 0 and step & (step - 1) == 0 and 16 <= step <= cfg.block_k
    assert cfg.num_stages * (cfg.block_n + 2 * block_m) * step * 2 <= SMEM_BUDGET
