"""On one GPU: the residual add + RMSNorm inside the MoE routing launch
(layers/moe/kernels/triton_route_norm.py, ``route_triton(..., norm=RouteNorm(...))``) and
``--norm-into-route`` in a model.

The launch in bf16 at the routers of qwen3-30b-a3b (128 experts, hidden 2048, top-8) and
Mixtral-8x7B (8 experts, hidden 4096, top-2), renormalised, 1 to 32 tokens and 256 (at most 2048
slots): 1 token on the launch's default path, the others on the one-launch path asked for (the
norm runs there only; `norm_refusal` names the default's bound for them), a bf16 router bias N(0,
1) in some cases (gpt-oss's form of the launch); x and the
residual N(0, 1), the norm weight 1 + N(0, 0.1), the gate N(0, 1 / hidden). Against the torch
reference on the GPU (`fusion.reference.add_rms_norm`):
- the new residual equal to the reference's rounded sum bit for bit; x and the old residual
  unchanged;
- the normed h within two bf16 ulps of the reference's (rtol 2^-7, atol 2^-14: an element may
  round the other way where ``1 / sqrt`` or the sum of squares rounds differently);
- the launch's logits within (1e-4, 1e-4) of `router_logits_torch` of its own h; its ids equal
  to `select_experts` of its own logits, its weights within (1e-5, 1e-5); against today's routing
  launch of its own h: the same ids, weights within (1e-6, 1e-6), the same grouping by expert;
  against today's routing of the reference's h: the same ids, except at a near tie of the
  reference's logits (the k-th and (k+1)-th within 1e-2: an h element one ulp away moves a logit
  by about 1e-4);
- the counter zero after each call; a second call the same bits; a CUDA graph replayed with new
  inputs the eager bits.

The tiny Qwen3-MoE (``tiny-moe``) in bf16 at TP1, eager, one prompt (decode at batch 1),
``norm_into_route`` off and on: the norm runs inside the routing launch with it on only (counted as the calls that hand `route_triton` a
norm), and every routing launch's fp32 logits are recorded. Each launch sees logits within 2e-2
relative L2 of the flag-off run's (the bf16 bound of tests/gpu/test_cuda_graph_decode.py) until a
token's experts differ, which they may only where the difference reaches the flag-off run's gap
between its k-th and (k+1)-th logits (a near tie: the launch's h may lie an ulp from
flashinfer's, and an expert flip changes a layer's output by far more than rounding). Up to that
step the greedy tokens are the same and their logits within 2e-2 at every step; a token may flip
only at a near tie of the flag-off run, its top two logits closer than twice that bound times the
RMS logit; the runs are compared up to there. The fold under CUDA graphs (with PDL) is in
tests/gpu/test_pdl_decode.py."""
from typing import Optional

import pytest
import torch

from arfusion.fusion.tuning.timing import capture_cuda_graph
from tests.dist_utils import run_distributed
from tests.fold_checks import greedy_run, steps_in_agreement

pytest.importorskip("triton")

from arfusion.fusion import reference  # noqa: E402
from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm  # noqa: E402
from arfusion.layers.moe.kernels.triton_router import (FUSED_MAX_SLOTS, norm_refusal, route_triton,  # noqa: E402
                                                       route_triton_with_logits)
from arfusion.layers.moe.router import router_logits_torch, select_experts  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEVICE = torch.device("cuda", 0)
EPS = 1e-6
SHAPES = {"qwen3-30b-a3b": (128, 2048, 8), "mixtral-8x7b": (8, 4096, 2)}  # (E, hidden, top_k)
NORMED_TOL = dict(rtol=2 * 2.0 ** -8, atol=2.0 ** -14)
BLOCK_M = 16
NEAR_TIE = 1e-2


def _inputs(shape: str, tokens: int, bias: bool, seed: int) -> dict:
    experts, hidden, _ = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=DEVICE)

    return {"x": randn(tokens, hidden).bfloat16(), "residual": randn(tokens, hidden).bfloat16(),
            "norm_weight": (1 + 0.1 * randn(hidden)).bfloat16(), "gate": (randn(experts, hidden) / hidden ** 0.5).bfloat16(),
            "bias": randn(experts).bfloat16() if bias else None}


def _norm(inp: dict, residual_out=None, normed=None) -> RouteNorm:
    return RouteNorm(inp["residual"], inp["norm_weight"], EPS,
                     torch.empty_like(inp["x"]) if normed is None else normed,
                     torch.empty_like(inp["x"]) if residual_out is None else residual_out)


CASES = [(s, t) for s, (_, _, top_k) in SHAPES.items() for t in (*range(1, 33), 256) if t * top_k <= FUSED_MAX_SLOTS]


@pytest.mark.parametrize("shape,tokens", CASES)
def test_matches_the_reference(shape, tokens):
    _, _, top_k = SHAPES[shape]
    inp = _inputs(shape, tokens, bias=tokens % 8 == 1, seed=tokens)
    before = {name: inp[name].clone() for name in ("x", "residual")}
    refusal = norm_refusal(inp["x"], inp["residual"], inp["norm_weight"], top_k)
    assert refusal is None if tokens == 1 else "one-launch path only" in refusal
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    norm = _norm(inp)
    weights, ids, blocks, logits = route_triton_with_logits(inp["x"], inp["gate"], top_k, True, counter, BLOCK_M,
                                                            inp["bias"], norm, one_launch=True)
    assert int(counter) == 0
    normed_ref, summed_ref = reference.add_rms_norm(inp["x"], inp["residual"], inp["norm_weight"], EPS)
    assert torch.equal(norm.residual_out, summed_ref)
    assert all(torch.equal(inp[name], before[name]) for name in before), "x and the old residual are only read"
    torch.testing.assert_close(norm.normed, normed_ref, **NORMED_TOL)

    torch.testing.assert_close(logits, router_logits_torch(norm.normed, inp["gate"], inp["bias"]), rtol=1e-4, atol=1e-4)
    own_weights, own_ids = select_experts(logits, top_k, True)
    assert torch.equal(ids, own_ids)
    torch.testing.assert_close(weights, own_weights, rtol=1e-5, atol=1e-5)
    today = route_triton(norm.normed, inp["gate"], top_k, True, counter, BLOCK_M, inp["bias"], one_launch=True)
    assert torch.equal(ids, today[1])
    torch.testing.assert_close(weights, today[0], rtol=1e-6, atol=1e-6)
    for field in ("sorted_slots", "block_expert", "num_rows"):
        assert torch.equal(getattr(blocks, field), getattr(today[2], field)), field

    _, ref_ids, _, ref_logits = route_triton_with_logits(normed_ref, inp["gate"], top_k, True, counter, BLOCK_M,
                                                         inp["bias"])
    differ = (ids != ref_ids).any(dim=1)
    if bool(differ.any()) and top_k < ref_logits.shape[1]:
        top = ref_logits[differ].topk(top_k + 1, dim=-1).values
        assert bool((top[:, top_k - 1] - top[:, top_k] <= NEAR_TIE).all()), "ids differ only at a near tie"

    again = _norm(inp)
    weights2, ids2, _, logits2 = route_triton_with_logits(inp["x"], inp["gate"], top_k, True, counter, BLOCK_M,
                                                          inp["bias"], again, one_launch=True)
    assert torch.equal(weights2, weights) and torch.equal(ids2, ids) and torch.equal(logits2, logits)
    assert torch.equal(again.normed, norm.normed) and torch.equal(again.residual_out, norm.residual_out)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cuda_graph_replay_gives_the_eager_bits(shape):
    _, _, top_k = SHAPES[shape]
    inp = _inputs(shape, 8, bias=True, seed=7)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    norm = _norm(inp)
    graph, (weights, ids, blocks) = capture_cuda_graph(
        lambda: route_triton(inp["x"], inp["gate"], top_k, True, counter, BLOCK_M, inp["bias"], norm, True))
    for seed in (8, 9):
        fresh = _inputs(shape, 8, bias=True, seed=seed)
        for name in ("x", "residual"):
            inp[name].copy_(fresh[name])
        graph.replay()
        eager_norm = _norm(inp)
        eager = route_triton(inp["x"], inp["gate"], top_k, True, counter, BLOCK_M, inp["bias"], eager_norm, True)
        assert torch.equal(weights, eager[0]) and torch.equal(ids, eager[1])
        assert torch.equal(blocks.sorted_slots, eager[2].sorted_slots)
        assert torch.equal(norm.normed, eager_norm.normed) and torch.equal(norm.residual_out, eager_norm.residual_out)
    assert int(counter) == 0


PROMPTS, PROMPT_LEN, STEPS, MAX_REL_ERR = 1, 16, 24, 2e-2  # decode at batch 1: the batches the launch normalises


def _greedy(rank: int, world: int) -> dict:
    """Eager greedy runs of the tiny Qwen3-MoE with the flag off and on: tokens and logits per
    step, and every routing launch's ids and fp32 logits in call order (one call a MoE layer a
    forward), the calls that handed the launch a norm counted."""
    from arfusion.layers.moe.kernels import triton_router

    normed_calls = [0]
    routes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recorded(*args, **kwargs):
        normed_calls[0] += (args[7] if len(args) > 7 else kwargs.get("norm")) is not None
        weights, ids, blocks, logits = triton_router.route_triton_with_logits(*args, **kwargs)
        routes.append((ids.cpu(), logits.cpu()))
        return weights, ids, blocks

    triton_router.route_triton = recorded
    out: dict = {}
    for on in (False, True):
        normed_calls[0] = 0
        routes.clear()
        out[on] = greedy_run("tiny-moe", PROMPTS, PROMPT_LEN, STEPS, seed=5, dtype="bfloat16", disable_cuda_graph=True,
                             max_running_requests=4, kv_slots=1024, norm_into_route=on)
        out[on].update(normed_calls=normed_calls[0], routes=list(routes))
    return out


def _first_expert_flip(off: dict, on: dict, layers: int, top_k: int, last_step: int) -> Optional[int]:
    """The first step (0: the prefill) up to ``last_step`` at which a token's experts differ
    between the runs, None if none does. Every routing call compared up to there must see logits
    within ``MAX_REL_ERR`` (relative L2 per token) of the flag-off run's: its h is the same up to
    rounding. A flip needs that difference to reach the flag-off run's gap between its k-th and
    (k+1)-th logits: where the two logit rows differ by at most d, a gap above 2d keeps the order."""
    for call, ((ids_off, l_off), (ids_on, l_on)) in enumerate(zip(off["routes"], on["routes"])):
        step = call // layers
        if step > last_step:
            return None
        rel = ((l_on - l_off).norm(dim=-1) / l_off.norm(dim=-1)).max().item()
        assert rel <= MAX_REL_ERR, ("router logits", step, call % layers, rel)
        flipped = (ids_off.sort(dim=-1).values != ids_on.sort(dim=-1).values).any(dim=-1)
        if bool(flipped.any()):
            top = l_off[flipped].topk(top_k + 1, dim=-1).values
            reach = 2 * (l_on - l_off)[flipped].abs().amax(dim=-1)
            assert bool((top[:, top_k - 1] - top[:, top_k] <= reach).all()), (step, top, reach)
            return step
    return None


@pytest.mark.timeout(600)
def test_tiny_moe_with_the_flag_on_and_off_agrees_up_to_a_near_tie():
    """The tiny Qwen3-MoE in bf16, eager, the flag off and on: the norm runs in the routing
    launch with the flag on only; every routing launch sees logits within 2e-2 of the flag-off
    run's until a token's experts differ, which they may only at a near tie (`_first_expert_flip`:
    the launch's h may lie an ulp from flashinfer's); up to that step the greedy tokens and their
    logits agree as for the other folds (`steps_in_agreement`: within 2e-2, a token flipping only
    at a near tie)."""
    result = run_distributed(_greedy, world_size=1, device_kind="cuda", timeout_s=500)[0]
    off, on = result[False], result[True]
    config = off["config"]
    assert off["normed_calls"] == 0 and on["normed_calls"] > 0, "the norm runs in the routing launch with the flag on only"
    layers, steps = config.num_hidden_layers, len(off["tokens"])
    assert len(off["routes"]) == len(on["routes"]) == steps * layers, (len(off["routes"]), steps * layers)
    token_flip = next((s for s, (a, b) in enumerate(zip(off["tokens"], on["tokens"])) if a != b), steps - 1)
    flip = _first_expert_flip(off, on, layers, config.num_experts_per_tok, token_flip)
    end = steps if flip is None else flip
    compared = steps_in_agreement({k: off[k][:end] for k in ("tokens", "logits")},
                                  {k: on[k][:end] for k in ("tokens", "logits")}, MAX_REL_ERR)
    print(f"\nnorm into routing: greedy tokens equal over {compared} of {steps} steps; first expert flip at step "
          f"{flip} (a near tie)")
