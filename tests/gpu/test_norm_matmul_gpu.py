"""On one GPU: the residual add + RMSNorm + q/k/v matmul launch (layers/kernels/triton_norm_matmul.py)
and ``--norm-into-qkv`` in a model.

The launch in bf16 at the q/k/v shapes of qwen3-30b-a3b (K 2048, N 5120) and llama3-8b (K 4096,
N 6144), 1 to 32 tokens (x, residual N(0, 1), norm weight 1 + N(0, 0.1), W N(0, 0.02), a bias
N(0, 1) in some cases), against the torch reference on the GPU (`fusion.reference.add_rms_norm`,
then an fp32 matmul of its normed output, rounded once): within two bf16 ulps (rtol 2^-6, atol
2^-7: one rounding of y, and an element of h one ulp from the reference's where the 1 / sqrt or
the sum of squares rounds differently); the new residual equal to the reference's sum bit for
bit; x and the old residual unchanged; two calls the same bits; a CUDA graph replayed with new
inputs the eager bits; against today's path (`fusion.norm.add_rms_norm`, flashinfer's kernel
where it is installed, then cuBLAS) a relative RMS difference of at most 5e-3.

The tiny model in bf16 at TP1 with CUDA graphs, ``norm_into_qkv`` off and on: the launch is
captured only with it on, and the greedy tokens are the same, their logits within 2e-2 relative
L2 at every step (the bf16 bound of tests/gpu/test_cuda_graph_decode.py). A token may flip only
at a near tie of the flag-off run, its top two logits closer than twice that bound times the
RMS logit (rounding, not a fault); the runs are compared up to there."""
import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.fold_checks import greedy_run, steps_in_agreement

pytest.importorskip("triton")

pytestmark = pytest.mark.gpus(1)

EPS = 1e-6
SHAPES = {"qwen3-30b-a3b": (5120, 2048), "llama3-8b": (6144, 4096)}  # q/k/v (N, K) at TP1
BF16_ULP = 2.0 ** -7
RTOL, ATOL = 2 * BF16_ULP, BF16_ULP


def _inputs(t: int, n: int, k: int, bias: bool, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    return {"x": randn(t, k).bfloat16(), "residual": randn(t, k).bfloat16(),
            "norm_weight": (1 + 0.1 * randn(k)).bfloat16(), "weight": (0.02 * randn(n, k)).bfloat16(),
            "bias": randn(n).bfloat16() if bias else None}


def _launch(inp: dict, residual_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    from arfusion.layers.kernels.triton_norm_matmul import norm_linear

    return norm_linear(inp["x"], inp["residual"], inp["norm_weight"], EPS, inp["weight"], inp["bias"], residual_out)


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("tokens", range(1, 33))
def test_matches_the_reference_and_is_deterministic(model, tokens):
    from arfusion.fusion import reference
    from arfusion.layers.kernels.triton_norm_matmul import refusal

    n, k = SHAPES[model]
    inp = _inputs(tokens, n, k, bias=tokens % 8 == 1, seed=tokens)
    before = {name: inp[name].clone() for name in ("x", "residual")}
    assert refusal(inp["x"], inp["residual"], inp["norm_weight"], inp["weight"], inp["bias"]) is None
    y, summed = _launch(inp)
    h, summed_ref = reference.add_rms_norm(inp["x"], inp["residual"], inp["norm_weight"], EPS)
    bias = inp["bias"].float() if inp["bias"] is not None else None
    y_ref = F.linear(h.float(), inp["weight"].float(), bias).bfloat16()
    torch.testing.assert_close(y, y_ref, rtol=RTOL, atol=ATOL)
    assert torch.equal(summed, summed_ref)
    assert all(torch.equal(inp[name], before[name]) for name in before), "x and the old residual are only read"
    again, summed_again = _launch(inp)
    assert torch.equal(again, y) and torch.equal(summed_again, summed)


@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_close_to_the_separate_norm_and_cublas(tokens):
    from arfusion.fusion import norm

    n, k = SHAPES["llama3-8b"]
    inp = _inputs(tokens, n, k, bias=False, seed=100 + tokens)
    y, summed = _launch(inp)
    normed, summed_today = norm.add_rms_norm(inp["x"].clone(), inp["residual"].clone(), inp["norm_weight"], EPS)
    today = F.linear(normed, inp["weight"])
    assert torch.equal(summed, summed_today)
    rel_rms = ((y.float() - today.float()).pow(2).mean().sqrt() / today.float().pow(2).mean().sqrt()).item()
    assert rel_rms <= 5e-3, rel_rms


def test_cuda_graph_replay_gives_the_eager_bits():
    n, k = SHAPES["qwen3-30b-a3b"]
    inp = _inputs(8, n, k, bias=True, seed=7)
    residual_out = torch.empty_like(inp["residual"])
    _launch(inp, residual_out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _launch(inp, residual_out)
    fresh = _inputs(8, n, k, bias=True, seed=8)
    for name in ("x", "residual"):
        inp[name].copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    eager, eager_summed = _launch(inp)
    assert torch.equal(out, eager) and torch.equal(residual_out, eager_summed)


def test_batches_it_does_not_take_are_named():
    from arfusion.layers.kernels.triton_norm_matmul import refusal

    n, k = SHAPES["llama3-8b"]
    big = _inputs(33, n, k, bias=False, seed=1)
    assert "at most 32 tokens" in refusal(big["x"], big["residual"], big["norm_weight"])
    fp32 = {name: t.float() for name, t in _inputs(2, n, k, bias=False, seed=2).items() if t is not None}
    assert "fp16 and bf16" in refusal(fp32["x"], fp32["residual"], fp32["norm_weight"])


PROMPTS, PROMPT_LEN, STEPS, MAX_REL_ERR = 3, 16, 24, 2e-2


def _greedy(rank: int, world: int) -> dict:
    from arfusion.layers.kernels.triton_norm_matmul import NORM_MATMUL_LAUNCHER

    out: dict = {}
    for on in (False, True):
        compiled_before = len(NORM_MATMUL_LAUNCHER)
        out[on] = greedy_run("tiny", PROMPTS, PROMPT_LEN, STEPS, seed=5, dtype="bfloat16", cuda_graph_max_bs=4,
                             max_running_requests=4, kv_slots=1024, norm_into_qkv=on)
        assert out[on]["graphs"]
        out[on]["launch_compiled"] = len(NORM_MATMUL_LAUNCHER) > compiled_before
    return out


@pytest.mark.timeout(600)
def test_tiny_model_greedy_tokens_with_the_flag_on_and_off_under_cuda_graphs():
    result = run_distributed(_greedy, world_size=1, device_kind="cuda", timeout_s=500)[0]
    off, on = result[False], result[True]
    assert not off["launch_compiled"] and on["launch_compiled"], "the launch runs with the flag on only"
    compared = steps_in_agreement(off, on, MAX_REL_ERR)
    print(f"\nnorm into q/k/v: greedy tokens equal over {compared} of {len(off['tokens'])} steps")
