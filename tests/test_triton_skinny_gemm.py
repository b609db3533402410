"""The Triton skinny GEMM (layers/triton_skinny_gemm.py) under the CPU interpreter against
torch's F.linear in fp32: random inputs, M from 1 to MAX_M (padded tiles), N and K not multiples
of the blocks (masked edges), with and without bias, leading batch dims, strided x rows. fp16
only: the interpreter's tl.dot does not emulate bf16 (numpy has no bf16); the bf16 path is
checked on the GPU (tests/gpu/test_triton_skinny_gemm.py)."""
import pytest
import torch

pytest.importorskip("triton")

from layers.triton_skinny_gemm import MAX_M, SkinnyConfig, skinny_gemm_unavailable_reason  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402

# (m, n, k, dtype, bias, config or None)
CASES = [
    (1, 96, 256, torch.float16, False, None),
    (3, 70, 200, torch.float16, True, SkinnyConfig(32, 64, 4, 2)),  # edges in N and K
    (16, 64, 128, torch.float16, True, SkinnyConfig(16, 128, 4, 3)),
    (33, 48, 96, torch.float16, False, SkinnyConfig(16, 32, 4, 2)),  # BLOCK_M 64 with 31 padded rows
    (MAX_M, 40, 64, torch.float16, True, SkinnyConfig(32, 32, 4, 2)),
]
# fp32 accumulation of fp16 products, one rounding of the output (half an ulp, ~5e-4 relative)
# plus the reference's own summation order
TOLERANCES = {torch.float16: (2e-3, 2e-3)}


def _interpreted(rank, world_size):
    from unittest import mock

    import layers.triton_skinny_gemm as sg

    results = []
    # the interpreter runs on CPU tensors: accept them where the GPU check would refuse
    with mock.patch.object(sg, "skinny_gemm_unavailable_reason", lambda x, w: None):
        for m, n, k, dtype, with_bias, config in CASES:
            g = torch.Generator().manual_seed(m * 1000 + n + k)
            x = torch.randn(m, k + 8, generator=g).to(dtype)[:, 4:4 + k]  # rows strided by k + 8
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if with_bias else None
            y = sg.skinny_linear(x, w, b, config=config)
            ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            batched = sg.skinny_linear(x.reshape(1, m, k), w, b, config=config)
            results.append({"shape": tuple(y.shape), "dtype": y.dtype, "y": y.float(), "ref": ref,
                            "batched_equal": torch.equal(batched.reshape(m, n), y)})
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_under_triton_interpreter(_interpreted, timeout_s=240)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-{str(c[3])[6:]}-bias{c[4]}" for c in CASES])
def test_skinny_gemm_matches_fp32_linear(interpreted, index):
    m, n, k, dtype, _, _ = CASES[index]
    r = interpreted[index]
    assert r["shape"] == (m, n) and r["dtype"] == dtype and r["batched_equal"]
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(r["y"], r["ref"], rtol=rtol, atol=atol)


def test_unavailable_reasons_name_the_problem():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert "CUDA" in skinny_gemm_unavailable_reason(torch.randn(2, 16, dtype=torch.bfloat16), w)
