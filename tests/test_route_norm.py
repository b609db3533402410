"""The residual add + RMSNorm inside the MoE routing launch (layers/moe/kernels/triton_route_norm.py,
``route_triton(..., norm=RouteNorm(...))``) under Triton's CPU interpreter, against the reference:
`fusion.reference.add_rms_norm`, then today's routing launch of its normed output. Every case
runs in one spawned process with TRITON_INTERPRET=1 (tests/dist_utils.py).

Cases: 8, 32, 60 and 128 experts (top 2, 4, 4, 8), hidden 80 (one ragged split) and 300 (two,
the last ragged), 1, 3, 8, 24 and 256 tokens (the norm runs on the one-launch path, its default at
1 token and asked for beyond: 24 tokens are three selection steps at 128 experts; 256 tokens at 8
experts top-8 fill FUSED_MAX_SLOTS' 2048 slots), fp32 and fp16, renormalised or not, a router bias (gpt-oss's launch)
or not, the slots grouped by expert (16- and 64-row blocks) or not. x and the residual N(0, 1),
the norm weight 1 + N(0, 0.1), the gate N(0, 1 / hidden), the bias N(0, 1).

- residual_out: the reference's rounded sum, bit for bit; x and the old residual unchanged;
- normed: fp32 within (1e-6, 1e-6) (``1 / sqrt`` and the sum of squares round in another order
  than torch's ``rsqrt`` and mean: a few fp32 ulps of ``inv``); fp16 within two fp16 ulps of the
  reference (rtol 2^-9; atol 2^-23, two ulps of fp16's smallest subnormal);
- ids: equal to today's routing of the reference's normed output; weights within (1e-6, 1e-6)
  of its weights (logits from an h that may differ by an ulp); the grouping by expert equal,
  tensor for tensor; the arrival counter zero again;
- the launch's own logits within (1e-5, 1e-5) of `router_logits_torch` of its own normed output.
Then, in this process: bad outputs and too large a batch raise ValueError naming the problem
before any launch, and `norm_refusal` names why a batch takes the separate norm; and compiled for
sm90 without a GPU (tests/offline_triton.py, ptxas included; skipped where triton's NVIDIA backend
is missing), bf16 at qwen3-30b-a3b's and Mixtral's routers, 1, 8 and 24 tokens on the one-launch
path: the launch with
the norm takes the dots of the launch without it (mma.sync, k16 instructions, K extents of 128)
and reduces the selection's two sums over the same layouts, so its routing of an h is today's.
"""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.fusion import reference  # noqa: E402
from arfusion.layers.moe.router import router_logits_torch  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402

EPS = 1e-6
FP16_ULP = 2.0 ** -10
NORMED_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=2 * FP16_ULP, atol=2.0 ** -23)}
WEIGHTS_TOL = dict(rtol=1e-6, atol=1e-6)
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)
# name -> (experts, top_k, hidden, tokens, dtype, renormalize, bias, block_m)
CASES = {
    "1 token fp32": (128, 8, 300, 1, torch.float32, True, False, 16),
    "1 token fp16, bias": (8, 2, 80, 1, torch.float16, True, True, None),
    "3 tokens fp16, 60 experts": (60, 4, 300, 3, torch.float16, False, False, 16),
    "3 tokens fp32, bias": (32, 4, 80, 3, torch.float32, True, True, None),
    "8 tokens fp32": (8, 2, 80, 8, torch.float32, True, False, 64),
    "8 tokens fp16": (128, 8, 300, 8, torch.float16, True, False, 16),
    "256 tokens fp16, bias, 2048 slots": (8, 8, 80, 256, torch.float16, True, True, 16),
    "24 tokens fp32, top-8": (128, 8, 80, 24, torch.float32, True, False, 16),
}


def case_inputs(name: str) -> dict:
    """A case's inputs, seeded by its name."""
    experts, _, hidden, tokens, dtype, _, bias, _ = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 11 + tokens)
    return {"x": torch.randn(tokens, hidden, generator=g).to(dtype),
            "residual": torch.randn(tokens, hidden, generator=g).to(dtype),
            "norm_weight": (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype),
            "gate": (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(dtype),
            "bias": torch.randn(experts, generator=g).to(dtype) if bias else None}


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm
    from arfusion.layers.moe.kernels.triton_router import route_triton_with_logits

    results = {}
    for name, (_, top_k, _, _, _, renormalize, _, block_m) in CASES.items():
        inp = case_inputs(name)
        x, residual = inp["x"].clone(), inp["residual"].clone()
        norm = RouteNorm(residual, inp["norm_weight"], EPS, torch.empty_like(x), torch.empty_like(x))
        counter = torch.zeros(1, dtype=torch.int32)
        fused = route_triton_with_logits(x, inp["gate"], top_k, renormalize, counter, block_m, inp["bias"], norm,
                                         one_launch=True)
        normed_ref, _ = reference.add_rms_norm(inp["x"], inp["residual"], inp["norm_weight"], EPS)
        today = route_triton_with_logits(normed_ref, inp["gate"], top_k, renormalize, counter, block_m, inp["bias"],
                                         one_launch=True)
        results[name] = {"fused": fused, "today": today, "normed": norm.normed, "residual_out": norm.residual_out,
                         "x": x, "residual": residual, "counter": int(counter)}
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(_interpreted, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_the_norm_inside_the_routing_launch_matches_the_reference(interpreted, name):
    _, _, _, _, dtype, _, bias, block_m = CASES[name]
    inp = case_inputs(name)
    got = interpreted[name]
    normed_ref, summed_ref = reference.add_rms_norm(inp["x"], inp["residual"], inp["norm_weight"], EPS)
    assert torch.equal(got["residual_out"], summed_ref), "the rounded sum, bit for bit"
    assert torch.equal(got["x"], inp["x"]) and torch.equal(got["residual"], inp["residual"]), "inputs only read"
    torch.testing.assert_close(got["normed"], normed_ref, **NORMED_TOL[dtype])
    weights, ids, blocks, logits = got["fused"]
    today_weights, today_ids, today_blocks, _ = got["today"]
    assert got["counter"] == 0, "the arrival counter is zero again"
    assert torch.equal(ids, today_ids)
    torch.testing.assert_close(weights, today_weights, **WEIGHTS_TOL)
    bias_f = inp["bias"] if bias else None
    torch.testing.assert_close(logits, router_logits_torch(got["normed"], inp["gate"], bias_f), **LOGITS_TOL)
    if block_m is None:
        assert blocks is None and today_blocks is None
        return
    for field in ("sorted_slots", "block_expert", "num_rows"):
        assert torch.equal(getattr(blocks, field), getattr(today_blocks, field)), field


def _norm(x: torch.Tensor, **outputs):
    from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm

    fields = {"residual": torch.randn_like(x), "weight": torch.ones(x.shape[1], dtype=x.dtype), "eps": EPS,
              "normed": torch.empty_like(x), "residual_out": torch.empty_like(x)}
    fields.update(outputs)
    return RouteNorm(**fields)


def test_bad_norm_inputs_are_named_before_any_launch():
    from arfusion.layers.moe.kernels.triton_router import route_triton

    counter = torch.zeros(1, dtype=torch.int32)
    x, gate = torch.randn(3, 32), torch.randn(8, 32)
    cases = {
        "tensor of its own": _norm(x, residual_out=x),
        "normed must be a contiguous": _norm(x, normed=torch.empty(3, 16)),
        "two tensors": (lambda out: _norm(x, normed=out, residual_out=out))(torch.empty_like(x)),
        "residual must be": _norm(x, residual=torch.randn(3, 32).half()),
        r"norm weight must be \[32\]": _norm(x, weight=torch.ones(16)),
    }
    for match, norm in cases.items():
        with pytest.raises(ValueError, match=match):
            route_triton(x, gate, 2, True, counter, norm=norm)
    two, five = torch.randn(2, 32), torch.randn(5, 32)
    with pytest.raises(ValueError, match=r"one-launch path only \(at most 1 token\(s\) .*up to 4 tokens where .*got 5 tokens and 10 slots"):
        route_triton(five, gate, 2, True, counter, norm=_norm(five))
    with pytest.raises(ValueError, match=r"one-launch path only .*got 2 tokens"):
        route_triton(two, gate, 2, True, counter, norm=_norm(two), one_launch=False)


def test_norm_refusal_names_the_batches_it_leaves_to_the_separate_norm():
    from arfusion.layers.moe.kernels.triton_router import FUSED_MAX_SLOTS, norm_refusal

    def refusal(tokens: int, top_k: int = 2) -> str:
        x = torch.randn(tokens, 32)
        return norm_refusal(x, torch.randn_like(x), torch.ones(32), top_k)

    assert f"at most 1 token(s) and {FUSED_MAX_SLOTS} slots" in refusal(2)
    assert "not on a CUDA device" in refusal(1), "one token takes the one-launch path"
    assert refusal(24) == refusal(2), "no token count of the batch in the reason"


@pytest.fixture(scope="module")
def offline():
    offline_triton = pytest.importorskip("tests.offline_triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton's NVIDIA backend is not installed")
    return offline_triton


@pytest.mark.parametrize("experts,hidden,top_k", [(128, 2048, 8), (8, 4096, 2)], ids=["qwen3-30b-a3b", "mixtral"])
def test_sm90_the_norm_keeps_the_routing_launch_dots_and_sums(offline, monkeypatch, experts, hidden, top_k):
    from arfusion.layers.moe.kernels import triton_router
    from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm

    kernel = offline.RecordedKernel(triton_router._route_kernel)
    monkeypatch.setattr(triton_router, "_route_kernel", kernel)
    monkeypatch.setattr(triton_router.triton.knobs.runtime, "interpret", False)
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(experts, hidden, generator=g).bfloat16()
    for tokens in (1, 8, 24):
        x = torch.randn(tokens, hidden, generator=g).bfloat16()
        norm = RouteNorm(torch.randn_like(x), torch.ones(hidden).bfloat16(), EPS, torch.empty_like(x),
                         torch.empty_like(x))
        for with_norm in (None, norm):
            triton_router.route_triton(x, gate, top_k, True, torch.zeros(1, dtype=torch.int32), 16, None, with_norm,
                                       one_launch=True)
    compiled = {}
    for args, kwargs in kernel.calls:
        asm = offline.compiled_asm(kernel.fn, args, kwargs)
        ir = offline.ttgir(kernel.fn, args, kwargs)
        selection_sums = offline.add_reduction_layouts(ir)[-2:]  # the norm's sums of squares come first
        compiled.setdefault(kwargs["NORM"], []).append(
            (offline.mma_versions(ir), offline.ptx_mma_k(asm["ptx"]), offline.dot_k_extents(ir), selection_sums))
    assert len(compiled[True]) == 3 and compiled[True] == compiled[False]
    assert all(versions == [2] and ks == {16} and set(extents) == {128} for versions, ks, extents, _ in compiled[True])
