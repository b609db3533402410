"""The decode-sized matmul launch (layers/kernels/triton_skinny_matmul.py) against an fp32 matmul
of the same fp16 inputs under Triton's CPU interpreter (fp16: the interpreter's bf16 dots multiply
bit patterns; bf16 runs in tests/gpu/test_skinny_matmul_gpu.py), in one spawned child with
TRITON_INTERPRET=1; skipped without triton. Cases: 1 to 32 rows (padded to 16 and 32), K a
multiple of the K step or not (a masked tail), N a multiple of the output tile or not (a masked
last tile), with and without a bias; the default tiles and small ones. Inputs N(0, 1), outputs
rounded once to fp16: rtol = atol = 2e-3 (fp16's half ulp is 4.9e-4 of the value; the fp32 sums
run in another order than the reference's). Bad inputs: a ValueError naming the problem."""
import pytest
import torch

from tests.dist_utils import run_under_triton_interpreter

TOL = 2e-3
# (rows, N, K, bias, tiles (block_n, block_k, warps, stages) or None for the default)
CASES = [(1, 40, 96, True, (16, 32, 4, 2)), (5, 64, 128, False, (16, 32, 4, 2)), (17, 33, 80, True, (32, 16, 2, 3)),
         (32, 48, 256, True, (16, 64, 4, 2)), (3, 96, 512, False, None), (1, 2050, 512, True, None)]


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.kernels.triton_skinny_matmul import SkinnyConfig, skinny_linear

    results = {}
    for seed, case in enumerate(CASES):
        m, n, k, has_bias, tiles = case
        g = torch.Generator().manual_seed(seed)
        x, w = torch.randn(m, k, generator=g).half(), torch.randn(n, k, generator=g).half()
        bias = torch.randn(n, generator=g).half() if has_bias else None
        out = skinny_linear(x, w, bias, SkinnyConfig(*tiles) if tiles else None)
        ref = x.float() @ w.float().T + (bias.float() if has_bias else 0)
        results[case] = (out, ref.half())
    return results


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "rows{}-n{}-k{}{}-{}".format(
    c[0], c[1], c[2], "-bias" if c[3] else "", "default" if c[4] is None else "x".join(map(str, c[4]))))
def test_matches_fp32_matmul(interpreted, case):
    out, expected = interpreted[case]
    assert out.dtype == torch.float16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("x_shape, w_shape, dtypes, bias_shape, match", [
    ((2, 64), (32, 48), (torch.float16, torch.float16), None, "agree in K"),
    ((2, 64), (32, 64), (torch.float16, torch.bfloat16), None, "must both be fp16 or both bf16"),
    ((2, 64), (32, 64), (torch.float32, torch.float32), None, "must both be fp16 or both bf16"),
    ((33, 64), (32, 64), (torch.float16, torch.float16), None, "1 to 32 rows"),
    ((2, 64), (32, 64), (torch.float16, torch.float16), (31,), "bias must be"),
])
def test_bad_inputs_are_refused_by_name(x_shape, w_shape, dtypes, bias_shape, match):
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_skinny_matmul import skinny_linear

    bias = torch.zeros(bias_shape, dtype=dtypes[1]) if bias_shape else None
    with pytest.raises(ValueError, match=match):
        skinny_linear(torch.zeros(x_shape, dtype=dtypes[0]), torch.zeros(w_shape, dtype=dtypes[1]), bias)


def test_serves_only_cuda_decode_sized_narrowing_matmuls():
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_skinny_matmul import serves

    assert not serves(torch.zeros(1, 64, dtype=torch.float16), torch.zeros(32, 64, dtype=torch.float16))  # CPU


def test_the_pdl_prefetch_takes_whole_granules_of_aligned_rows_only():
    """`pdl_prefetch_cols`: the first 1,024 columns of a row, fewer for a narrower weight (whole
    16-byte granules in each of the PREFETCH_PARTS requests), none for rows that do not start on
    16 bytes."""
    pytest.importorskip("triton")
    from arfusion.layers.kernels.triton_skinny_matmul import PDL_PREFETCH_COLS, pdl_prefetch_cols

    bf16 = torch.bfloat16
    assert pdl_prefetch_cols(torch.zeros(64, 4096, dtype=bf16)) == PDL_PREFETCH_COLS == 1024
    assert pdl_prefetch_cols(torch.zeros(8, 104, dtype=bf16)) == 96  # 4 requests of 24 columns, 48 bytes each
    assert pdl_prefetch_cols(torch.zeros(8, 100, dtype=torch.float32)) == 96  # 4 of 24 columns, 96 bytes each
    assert pdl_prefetch_cols(torch.zeros(8, 16, dtype=bf16)) == 0  # under one granule a request
    assert pdl_prefetch_cols(torch.zeros(8, 100, dtype=bf16)) == 0  # rows 200 bytes apart
    assert pdl_prefetch_cols(torch.zeros(8, 104, dtype=bf16)[:, 1:97]) == 0  # rows start 2 bytes in
