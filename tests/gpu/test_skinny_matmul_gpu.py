"""On one GPU: the decode-sized matmul launch (layers/kernels/triton_skinny_matmul.py) in bf16 at
the row-parallel projection shapes it serves (the attention output of qwen3-30b-a3b, gpt-oss and
llama3-8b, llama3-8b's MLP down) at 1, 8 and 32 rows, with a bias, against an fp32 matmul of the
same bf16 inputs (N(0, 1) activations, weights N(0, 0.02)): relative RMS error at most 5e-3 (one
bf16 rounding of the output: about 2e-3); two calls give the same bits; a CUDA graph replayed with
new activations gives the eager bits; `layers.linear.row_parallel_matmul` takes it exactly where
`serves` says so outside batch-invariant mode, and never in it."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

pytestmark = pytest.mark.gpus(1)

SHAPES = [(2048, 4096), (2880, 4096), (4096, 4096), (4096, 14336)]


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    return w, torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_matches_fp32_matmul_and_is_deterministic(n, k, rows):
    from arfusion.layers.kernels.triton_skinny_matmul import skinny_linear

    w, b = _weights(n, k, n + rows)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    out = skinny_linear(x, w, b)
    ref = x.float() @ w.float().T + b.float()
    rel_rms = ((out.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel_rms <= 5e-3, rel_rms
    assert torch.equal(out, skinny_linear(x, w, b))


def test_cuda_graph_replay_gives_the_eager_bits():
    from arfusion.layers.kernels.triton_skinny_matmul import skinny_linear

    w, b = _weights(2880, 4096, 1)
    x = torch.randn(8, 4096, device="cuda").to(torch.bfloat16)
    skinny_linear(x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, w, b)
    x.copy_(torch.randn(8, 4096, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_linear(x, w, b))


def test_row_parallel_matmul_takes_it_where_it_serves():
    from arfusion.layers import batch_invariant
    from arfusion.layers.kernels.triton_skinny_matmul import serves, skinny_linear
    from arfusion.layers.linear import row_parallel_matmul

    w, b = _weights(2048, 4096, 2)
    x = torch.randn(4, 4096, device="cuda").to(torch.bfloat16)
    assert serves(x, w)
    assert torch.equal(row_parallel_matmul(x, w, b), skinny_linear(x, w, b))
    wide, _ = _weights(4096, 2048, 3)
    x_wide = torch.randn(4, 2048, device="cuda").to(torch.bfloat16)
    for refused in ((x_wide, wide), (torch.randn(33, 4096, device="cuda").to(torch.bfloat16), w),
                    (x.float(), w.float())):
        assert not serves(*refused)
        assert torch.equal(row_parallel_matmul(*refused, None), F.linear(*refused))
    with batch_invariant.batch_invariant_mode(True):
        assert torch.equal(row_parallel_matmul(x, w, b), batch_invariant.linear(x, w, b))
