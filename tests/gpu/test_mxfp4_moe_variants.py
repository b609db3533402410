"""Every variant of gpt-oss's experts kernel (layers/moe/kernels/triton_mxfp4_moe.py:
`Mxfp4MoEConfig`'s swap, word decoder, token blocks down to one row, K splits of the down
projection, the down launch's own warps and stages; the matrix-vector launches, gemv) on one
GPU at gpt-oss-20b's expert shapes (hidden 2880, intermediate 2880, 8 of its 32 experts to keep
the test short, top-4), bf16 activations, MXFP4 and bf16-form weights, 1 / 3 / 8 / 33 tokens,
against `GptOssExperts.forward_torch` on the same weights: relative RMS error at most 1e-2 (bf16: one
rounding of each product chain in a different order, as tests/gpu/test_gpt_oss_gpu.py); two
eager calls give the same bits (deterministic); a CUDA graph captured at 8 tokens and replayed
with new routing and new activations gives the eager bits."""
import pytest
import torch

from tests.dist_utils import run_distributed

pytest.importorskip("triton")

VARIANTS = {
    "swap_word": dict(block_m=8, block_n_gate_up=32, block_k_gate_up=256, block_n_down=32, block_k_down=256,
                      num_warps=2, swap=True, word_decode=True),
    "swap_word_split": dict(block_m=8, block_n_gate_up=64, block_k_gate_up=256, block_n_down=64, block_k_down=256,
                            num_warps=4, swap=True, word_decode=True, split_k_down=2),
    "swap_word_m1": dict(block_m=1, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32, block_k_down=128,
                         num_warps=2, swap=True, word_decode=True, split_k_down=3),
    "swap_bytes": dict(block_m=16, block_n_gate_up=64, block_k_gate_up=128, block_n_down=64, block_k_down=128,
                       swap=True),
    "word": dict(block_m=16, block_n_gate_up=32, block_k_gate_up=128, block_n_down=32, block_k_down=128,
                 word_decode=True),
    "k256_stages_down": dict(block_m=16, block_n_gate_up=32, block_k_gate_up=256, block_n_down=32, block_k_down=256,
                             num_stages=5, num_stages_down=3, split_k_down=2),
    "swap_word_warps_down": dict(block_m=8, block_n_gate_up=64, block_k_gate_up=256, block_n_down=64,
                                 block_k_down=256, num_warps=4, num_warps_down=8, swap=True, word_decode=True,
                                 split_k_down=2),
    "gemv": dict(block_m=1, block_n_gate_up=16, block_k_gate_up=512, block_n_down=16, block_k_down=512, gemv=True),
    "gemv_n32_k256": dict(block_m=1, block_n_gate_up=32, block_k_gate_up=256, block_n_down=32, block_k_down=256,
                          num_warps=8, gemv=True),
}
TOKENS = (1, 3, 8, 33)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


def _variant_rank(rank, world, mxfp4, variant):
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import Mxfp4MoEConfig
    from tests.test_gpt_oss_moe_triton import fill_experts

    experts = GptOssExperts(8, 2880, 2880, 1.702, 7.0, mxfp4, torch.bfloat16, None)
    fill_experts(experts, 7)
    experts.cuda()
    with torch.no_grad():  # weights of dummy size: activations of order one, as in the model
        for name in ("w13_weight", "w2_weight"):
            if hasattr(experts, name):
                getattr(experts, name).mul_(0.05)
    return config_results(experts, Mxfp4MoEConfig(**VARIANTS[variant]), TOKENS)


def config_results(experts, config, tokens_list: tuple[int, ...]) -> dict:
    """``config`` on ``experts`` (8 experts on the GPU, top-4, seeded random bf16 activations and
    routing): ``error`` (relative RMS against `GptOssExperts.forward_torch`) and ``deterministic``
    (two eager calls equal) by token count, ``graph`` (a CUDA graph captured at 8 tokens and
    replayed with new routing and activations gives the eager bits)."""
    from arfusion.layers.moe.kernels.triton_mxfp4_moe import gpt_oss_experts_triton

    g = torch.Generator().manual_seed(11)

    def inputs(tokens):
        x = torch.randn(tokens, 2880, generator=g).to(torch.bfloat16).cuda()
        ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(tokens)]).to(torch.int32).cuda()
        return x, torch.softmax(torch.randn(tokens, 4, generator=g), -1).cuda(), ids

    out = {"error": {}, "deterministic": {}}
    for tokens in tokens_list:
        x, weights, ids = inputs(tokens)
        fast = gpt_oss_experts_triton(x, experts, weights, ids, config)
        out["error"][tokens] = _rel_rms(fast, experts.forward_torch(x, weights, ids))
        again = gpt_oss_experts_triton(x, experts, weights, ids, config)
        out["deterministic"][tokens] = torch.equal(fast, again)
    x, weights, ids = inputs(8)
    gpt_oss_experts_triton(x, experts, weights, ids, config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gpt_oss_experts_triton(x, experts, weights, ids, config)
    for new, old in zip(inputs(8), (x, weights, ids)):
        old.copy_(new)
    graph.replay()
    eager = gpt_oss_experts_triton(x, experts, weights, ids, config)
    out["graph"] = torch.equal(captured, eager)
    return out


@pytest.mark.gpus(1)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "bf16form"])
def test_variant_matches_reference(mxfp4, variant):
    r = run_distributed(_variant_rank, world_size=1, args=(mxfp4, variant), device_kind="cuda", timeout_s=400)[0]
    print(f"\n{variant} mxfp4={mxfp4}: relative RMS error by tokens {r['error']}")
    assert all(r["error"][t] <= 1e-2 for t in TOKENS), r
    assert all(r["deterministic"].values()), r
    assert r["graph"], "a CUDA-graph replay with new routing gives the eager result"
