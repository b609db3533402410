"""The Triton skinny GEMM on one GPU at llama3-8b TP2 shapes, bf16 and fp16, M in 1..64:
against F.linear in fp32 (tolerance: fp32 accumulation of 16-bit products, one rounding of the
output), no worse than cuBLAS's own error against that reference (plus half a percent), and
through `layers.linear`'s dispatch inside a CUDA graph replayed with new inputs."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fusion.cuda_graph_timing import capture_cuda_graph  # noqa: E402
from layers.linear import linear  # noqa: E402
from layers.triton_skinny_gemm import skinny_linear  # noqa: E402

SHAPES = [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168), (1000, 136)]
DEVICE = torch.device("cuda", 0)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 32, 64])
def test_matches_fp32_and_cublas(m, n, k, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g, device=DEVICE, dtype=dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE, dtype=dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    y = skinny_linear(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    ours, cublas = rel_l2(y, ref), rel_l2(F.linear(x, w, b), ref)
    assert ours <= cublas * 1.005 + 1e-4, (ours, cublas)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


def test_linear_dispatch_in_a_cuda_graph():
    """`layers.linear.linear` takes the skinny kernel for <= 64 rows on the GPU; a graph captured
    with it replays new inputs correctly."""
    x = torch.randn(32, 2048, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(4096, 2048, device=DEVICE) / 2048 ** 0.5).to(torch.bfloat16)
    graph, out = capture_cuda_graph(lambda: linear(x, w, None))
    for seed in (1, 2):
        x.copy_(torch.randn(32, 2048, generator=torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE))
        graph.replay()
        torch.testing.assert_close(out, skinny_linear(x, w), rtol=0, atol=0)
