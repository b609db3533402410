"""Every entry of the batch-invariant matmul's measured table (layers/kernels/bi_matmul_table.py,
written by benchmarks/kernels/tune_bi_matmul.py) on one GPU, bf16, at its own (N, K): rows 0-6
have the same bits at M = 1, 7, 64, 128 and 512 (each M with its bucket's row tile, as
`choose_config` picks it), and the result is within tolerance of cuBLAS. Skipped while the repo
has no table (the default rule is covered by tests/gpu/test_batch_invariant_ops.py)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from arfusion.layers.kernels.bi_matmul_table import load_table  # noqa: E402
from arfusion.layers.kernels.triton_bi_matmul import choose_config, matmul  # noqa: E402
from tests.tolerances import TOLERANCES  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEV = torch.device("cuda", 0)
ROWS = (1, 7, 64, 128, 512)
SHAPES = sorted(load_table())


@pytest.mark.skipif(not SHAPES, reason="no bi-matmul table in the repo: run benchmarks/kernels/tune_bi_matmul.py")
@pytest.mark.parametrize("n, k", SHAPES or [(0, 0)])
def test_every_table_entry_gives_a_row_the_same_bits_at_any_batch(n, k):
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen, device=DEV) * 0.02).to(torch.bfloat16)
    x = torch.randn(max(ROWS), k, generator=gen, device=DEV).to(torch.bfloat16)
    assert len({(choose_config(n, k, m).block_k, choose_config(n, k, m).splits) for m in ROWS}) == 1
    full = matmul(x, w)
    for m in ROWS:
        assert torch.equal(matmul(x[:m], w)[:7], full[:min(m, 7)]), (m, choose_config(n, k, m))
    rtol, atol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(full[:64].float(), F.linear(x[:64], w).float(), rtol=rtol, atol=atol)
