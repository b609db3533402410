"""The launch cache (layers/kernels/triton_launch_cache.py) on one GPU, through the
batch-invariant matmul: the direct launch of a kept compiled kernel gives the bits of Triton's
normal launch for M = 1, 7, 16, 128, 129, x aligned, a row view (x[1:] of a larger tensor) and a
column slice whose data_ptr and row stride are not multiples of 16 bytes, with and without bias,
one and several K splits, all through one cache (a wrong hit would run a kernel compiled for
another specialization); and the same bits from a CUDA graph captured from cached launches and
replayed on new inputs."""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.kernels import triton_bi_matmul as bm  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEV = torch.device("cuda", 0)
DTYPE = torch.bfloat16
N, K = 1024, 2048
ROWS = (1, 7, 16, 128, 129)
CONFIGS = (None, bm.MatmulConfig(64, 64, 128, 1, 4, 4), bm.MatmulConfig(64, 64, 128, 4, 4, 4))


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, device=DEV)).to(DTYPE)


def _views(m: int, seed: int) -> dict[str, torch.Tensor]:
    """x [m, K]: contiguous, a row view x[1:] of a larger tensor, and a column slice 2 bytes in
    (data_ptr and row stride K + 1 not 16-byte multiples)."""
    wide = _randn(m, K + 1, seed=seed + 2)[:, 1:]
    assert wide.data_ptr() % 16 != 0 and wide.stride() == (K + 1, 1)
    return {"aligned": _randn(m, K, seed=seed), "rows": _randn(m + 1, K, seed=seed + 1)[1:], "cols": wide}


def _uncached(monkeypatch, *args, **kwargs) -> torch.Tensor:
    """``matmul`` with its launcher sending every call through ``kernel[grid](...)``."""
    with monkeypatch.context() as patch:
        patch.setattr(bm.MATMUL_LAUNCHER, "enabled", False)
        return bm.matmul(*args, **kwargs)


def test_cached_launches_give_the_bits_of_normal_launches(monkeypatch):
    w, b = _randn(N, K, seed=1, scale=0.02), _randn(N, seed=2)
    bm.MATMUL_LAUNCHER.clear()
    checked = 0
    for config in CONFIGS:
        for m in ROWS:
            for name, x in _views(m, seed=10 * m).items():
                for bias in (b, None):
                    want = _uncached(monkeypatch, x, w, bias, config)
                    hits = bm.MATMUL_LAUNCHER.hits
                    for _ in range(2):  # the first call may bind, the second is a direct launch
                        got = bm.matmul(x, w, bias, config)
                        assert torch.equal(got, want), (config, m, name, bias is None)
                    assert bm.MATMUL_LAUNCHER.hits > hits, (config, m, name)
                    checked += 1
    assert checked == len(CONFIGS) * len(ROWS) * 3 * 2


def test_a_cuda_graph_of_cached_launches_replays_the_normal_launches_bits(monkeypatch):
    w, b = _randn(N, K, seed=3, scale=0.02), _randn(N, seed=4)
    split = bm.MatmulConfig(64, 64, 128, 4, 4, 4)
    cases = [(x, bias, config) for m in ROWS for x in _views(m, seed=m).values()
             for bias, config in ((b, None), (None, split))]
    for x, bias, config in cases:  # bind every specialization outside the capture
        bm.matmul(x, w, bias, config)
    torch.cuda.synchronize()
    hits = bm.MATMUL_LAUNCHER.hits
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [bm.matmul(x, w, bias, config) for x, bias, config in cases]
    assert bm.MATMUL_LAUNCHER.hits == hits + len(cases)  # every captured launch was a direct one
    for seed in (100, 200):
        for i, (x, _, _) in enumerate(cases):
            x.copy_(_randn(*x.shape, seed=seed + i))
        graph.replay()
        torch.cuda.synchronize()
        for (x, bias, config), out in zip(cases, outs):
            assert torch.equal(out, _uncached(monkeypatch, x, w, bias, config)), (x.shape, bias is None, config)
