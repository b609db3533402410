"""gpt-oss's routing by the Triton router (layers/moe/kernels/triton_router.py: a bias, then the
renormalised top-k) under Triton's CPU interpreter, against gpt-oss's reference
(`router_logits_torch` with the bias, then `route_topk_softmax`: softmax over the k chosen
logits). Skipped without triton; every kernel call runs in one spawned process with
TRITON_INTERPRET=1.

Cases: 32 experts top-4 (gpt-oss-20b's router) and 8 experts top-4, hidden 80 (one ragged K
tile) and 300 (two splits, the last ragged); 1 token (the one-launch path by default), 5 and 33
tokens on the one-launch path asked for, 33 and 300 on the default two-launch path; fp32 and bf16; a seeded random bias N(0, 1) (bf16 for bf16);
ties: experts 2, 5 and 6 share one gate row and one bias value that win every token, so their
logits are equal bit for bit; and integer-valued h, W and bias (values in -2..2: exact fp32
logits, so the kernel's logits equal the reference's bit for bit, with many ties among them).

- logits: against `router_logits_torch(h, W, b)` within (1e-5, 1e-5) (only the order of the fp32
  sums and of the bias's add differs), exactly for integer-valued inputs;
- ids: equal to `route_topk_softmax` of the kernel's logits (the tie rule, exactly), and to
  the reference's ids for integer-valued inputs; the tied experts lowest index first;
- weights: within (1e-6, 1e-6) of `route_topk_softmax`'s (weights <= 1: the full softmax's
  quotients renormalised against the softmax of the k, a few fp32 ulps apart);
- batch invariance: a token's logits, weights and ids have the same bits in batches of 1, 7 and
  64 tokens, each on both paths, and in the two-launch batch of 300 (whose first 64 tokens are the
  batch of 64);
- `GptOssRouter.forward` taking the Triton path (as on a CUDA ``h``) returns the (weights fp32,
  ids int32) of its torch path, within the tolerance above.
"""
import pytest
import torch

pytest.importorskip("triton")

from arfusion.layers.moe.gpt_oss_moe import GptOssRouter, route_topk_softmax  # noqa: E402
from arfusion.layers.moe.router import router_logits_torch, select_experts  # noqa: E402
from tests.dist_utils import run_under_triton_interpreter  # noqa: E402

LOGITS = dict(rtol=1e-5, atol=1e-5)
WEIGHTS = dict(rtol=1e-6, atol=1e-6)
TOP_K = 4
TIED = (2, 5, 6)
# name -> (experts, hidden, tokens, dtype, inputs: "random" | "ties" | "integers")
# (the cases named "(one launch)" ask `route_triton_with_logits` for that path, the others take its default)
CASES = {
    "1 token": (32, 80, 1, torch.float32, "random"),
    "5 tokens bf16 (one launch)": (32, 300, 5, torch.bfloat16, "random"),
    "33 tokens (one launch)": (32, 300, 33, torch.float32, "random"),
    "33 tokens bf16, 8 experts": (8, 80, 33, torch.bfloat16, "random"),
    "300 tokens": (32, 80, 300, torch.float32, "random"),
    "300 tokens bf16": (8, 300, 300, torch.bfloat16, "random"),
    "ties (one launch)": (32, 80, 5, torch.float32, "ties"),
    "ties bf16": (32, 300, 300, torch.bfloat16, "ties"),
    "integers (one launch)": (32, 80, 33, torch.float32, "integers"),
    "integers bf16": (8, 80, 300, torch.bfloat16, "integers"),
}
INVARIANT_BATCHES = (1, 7, 64, 300)


def case_inputs(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h [T, hidden], W [E, hidden], bias [E])`` of a case in its dtype, seeded by its name."""
    experts, hidden, tokens, dtype, kind = CASES[name]
    g = torch.Generator().manual_seed(len(name) * 11 + tokens)
    if kind == "integers":
        h, weight, bias = (torch.randint(-2, 3, shape, generator=g).float()
                           for shape in ((tokens, hidden), (experts, hidden), (experts,)))
        return h.to(dtype), weight.to(dtype), bias.to(dtype)
    h = torch.randn(tokens, hidden, generator=g)
    weight = torch.randn(experts, hidden, generator=g) / hidden ** 0.5
    bias = torch.randn(experts, generator=g)
    if kind == "ties":  # a shared row along h's mean direction and one bias: the tied experts win
        h += 1.0
        weight[list(TIED)] = 4.0 * torch.rand(hidden, generator=g) / hidden ** 0.5
        bias[list(TIED)] = 1.0
    return h.to(dtype), weight.to(dtype), bias.to(dtype)


def _interpreted(rank: int, world: int) -> dict:
    from arfusion.layers.moe.kernels.triton_router import route_triton_with_logits

    results = {}
    for name in CASES:
        h, weight, bias = case_inputs(name)
        counter = torch.zeros(1, dtype=torch.int32)
        weights, ids, _, logits = route_triton_with_logits(h, weight, TOP_K, True, counter, 16, bias,
                                                           one_launch=True if name.endswith("(one launch)") else None)
        results[name] = (weights, ids, logits, int(counter))
    h, weight, bias = case_inputs("300 tokens")
    for tokens in INVARIANT_BATCHES:
        for one_launch in (None, True) if tokens < INVARIANT_BATCHES[-1] else (None,):
            weights, ids, _, logits = route_triton_with_logits(h[:tokens], weight, TOP_K, True,
                                                               torch.zeros(1, dtype=torch.int32), 16, bias,
                                                               one_launch=one_launch)
            results["batch", tokens, one_launch] = (weights, ids, logits)
    router = GptOssRouter(80, 32, TOP_K, torch.float32, None)
    router.weight.data.copy_(weight)
    router.bias.data.copy_(bias)
    router._triton = lambda hidden_states: True  # the CUDA dispatch, on the CPU
    results["module"] = router(h[:33])
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_triton_interpreter(_interpreted, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_routing_equals_gpt_oss_reference(interpreted, name):
    experts, _, tokens, _, kind = CASES[name]
    h, weight, bias = case_inputs(name)
    weights, ids, logits, counter = interpreted[name]
    assert counter == 0, "the arrival counter is zero again"
    assert logits.shape == (tokens, experts) and logits.dtype == torch.float32
    reference_logits = router_logits_torch(h, weight, bias)
    if kind == "integers":
        assert torch.equal(logits, reference_logits), "integer-valued inputs give exact logits"
    else:
        torch.testing.assert_close(logits, reference_logits, **LOGITS)
    expected_weights, expected_ids = route_topk_softmax(logits, TOP_K)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, TOP_K)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(ids, select_experts(logits, TOP_K, True)[1]), "the renormalised top-k picks the same"
    torch.testing.assert_close(weights, expected_weights, **WEIGHTS)
    if kind == "ties":
        assert bool((ids[:, :len(TIED)] == torch.tensor(TIED, dtype=torch.int32)).all()), "lowest index first"
    if kind == "integers":
        assert bool((logits[:, None, :] == logits[:, :, None]).triu(1).any()), "the case has ties"


@pytest.mark.parametrize("one_launch", [None, True], ids=["default path", "one launch"])
@pytest.mark.parametrize("tokens", INVARIANT_BATCHES[:-1])
def test_a_tokens_routing_bits_do_not_depend_on_the_batch(interpreted, tokens, one_launch):
    whole = interpreted["batch", INVARIANT_BATCHES[-1], None]
    for part, full in zip(interpreted["batch", tokens, one_launch], whole):
        assert torch.equal(part, full[:tokens])


def test_router_module_on_the_triton_path(interpreted):
    h, weight, bias = case_inputs("300 tokens")
    router = GptOssRouter(80, 32, TOP_K, torch.float32, None)
    router.weight.data.copy_(weight)
    router.bias.data.copy_(bias)
    expected_weights, expected_ids = router(h[:33])  # the torch path: h is on the CPU
    weights, ids = interpreted["module"]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **WEIGHTS)


def test_bad_bias_is_named():
    from arfusion.layers.moe.kernels.triton_router import route_triton

    counter = torch.zeros(1, dtype=torch.int32)
    h, weight = torch.randn(3, 16), torch.randn(8, 16)
    for bias in (torch.randn(7), torch.randn(8, 2)[:, 0], torch.arange(8)):
        with pytest.raises(ValueError, match="router bias"):
            route_triton(h, weight, 2, True, counter, bias=bias)
