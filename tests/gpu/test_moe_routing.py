"""The Triton routing (layers/moe/kernels/triton_router.py) on one GPU, bf16, at the routers of
Qwen3-30B-A3B (128 experts, hidden 2048, top-8, renormalised) and Mixtral-8x7B (8 experts, hidden
4096, top-2), against the torch reference (layers/moe/router.py, layers/moe/align.py).

Token counts 1, 8, 32, 256 and 300, 4096 on the default path (one launch at 1 token, two launches
beyond) and, up to 2048 slots, on the one-launch path asked for; and ties (experts 2, 5, 6 share
one gate row that wins every token):
- logits within (1e-4, 1e-4) of `router_logits_torch` (fp32 products and sums of the same bf16
  inputs; logits of magnitude ~3: only the order of the fp32 sums differs);
- ids equal to `select_experts` of the kernel's own logits, weights within (1e-5, 1e-5); tied
  experts lowest index first;
- the grouping equal to `align_by_expert` of the ids, tensor for tensor, on the one-launch path;
- the arrival counter zero after each call; a second call bit-identical to the first;
- batch invariance: a token's logits, weights and ids are the same bits alone and in a batch of 32,
  on either path.
Then the routing captured in a CUDA graph and replayed with new inputs (against eager calls), and,
printed with ``-s``, µs per call (CUDA graphs) of the routing before this kernel (fp32 F.linear,
torch softmax + topk, the grouping launch) and of the default routing with its grouping.

gpt-oss's router (a bias; softmax over the k chosen logits) at gpt-oss-20b's (32 experts) and
gpt-oss-120b's (128 experts) shapes, hidden 2880, top-4, bf16 with a bf16 bias N(0, 1), the same
token counts and ties (the tied experts also share their bias):
- logits within (1e-4, 1e-4) of `router_logits_torch(h, W, b)`; ids equal to
  `route_topk_softmax` of the kernel's own logits, weights within (2e-6, 2e-6) of its weights
  (weights <= 1; the full softmax renormalised against the softmax of the k, and libdevice's
  exp against torch's: a few fp32 ulps); the grouping, the counter and a second call as above;
- batch invariance: a token's logits, weights and ids alone, in a batch of 32 (either path) and
  in one of 300 (two launches) are the same bits;
- `GptOssRouter.forward` on CUDA captured in a CUDA graph and replayed with new inputs: the bits
  of `route_triton` with the bias; then, printed with ``-s``, µs per call of gpt-oss's routing
  before (fp32 copies of W and b, fp32 F.linear, sort, gather, softmax, int cast) and of
  `GptOssRouter.forward`.
"""
import pytest
import torch

from arfusion.fusion.tuning.timing import capture_cuda_graph, median_us_per_call

pytest.importorskip("triton")

from arfusion.layers.moe.align import align_by_expert  # noqa: E402
from arfusion.layers.moe.gpt_oss_moe import GptOssRouter, route_topk_softmax  # noqa: E402
from arfusion.layers.moe.kernels.triton_align import align_by_expert_triton  # noqa: E402
from arfusion.layers.moe.kernels.triton_router import (FUSED_MAX_SLOTS, route_triton,  # noqa: E402
                                                       route_triton_with_logits)
from arfusion.layers.moe.router import router_logits_torch, select_experts  # noqa: E402

pytestmark = pytest.mark.gpus(1)

DEVICE = torch.device("cuda", 0)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 8), "mixtral-8x7b": (8, 4096, 2)}  # (E, hidden, top_k)
TOKENS = (1, 8, 32, 256, 300, 4096)
TIED = (2, 5, 6)
BLOCK_M = 16


def inputs(shape: str, tokens: int, seed: int, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    experts, hidden, _ = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, device=DEVICE)
    weight = torch.randn(experts, hidden, generator=g, device=DEVICE) / hidden ** 0.5
    if ties:
        h += 1.0
        weight[list(TIED)] = 4.0 * torch.rand(hidden, generator=g, device=DEVICE) / hidden ** 0.5
    return h.bfloat16(), weight.bfloat16()


def paths(shapes: dict, tokens: int) -> list:
    """``one_launch`` values a case of ``tokens`` runs with: the default (None), and the one-launch path
    asked for (True) where it is not the default and the slots fit it."""
    fit = [s for s, (_, _, top_k) in shapes.items() if tokens * top_k <= FUSED_MAX_SLOTS]
    return [(s, None) for s in shapes] + [(s, True) for s in fit if tokens > 1]


def one_launch_taken(tokens: int, one_launch) -> bool:
    return bool(one_launch) or tokens == 1


CASES = [(s, t, False, p) for t in TOKENS for s, p in paths(SHAPES, t)] + [(s, 32, True, p) for s, p in paths(SHAPES, 32)]


@pytest.mark.parametrize("shape,tokens,ties,one_launch", CASES)
def test_against_torch_reference(shape, tokens, ties, one_launch):
    experts, _, top_k = SHAPES[shape]
    h, weight = inputs(shape, tokens, seed=tokens, ties=ties)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    weights, ids, blocks, logits = route_triton_with_logits(h, weight, top_k, True, counter, BLOCK_M,
                                                            one_launch=one_launch)
    assert int(counter) == 0
    torch.testing.assert_close(logits, router_logits_torch(h, weight), rtol=1e-4, atol=1e-4)
    expected_weights, expected_ids = select_experts(logits, top_k, True)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-5)
    if ties:
        first = min(top_k, len(TIED))
        assert bool((ids[:, :first] == torch.tensor(TIED[:first], dtype=torch.int32, device=DEVICE)).all())
    if not one_launch_taken(tokens, one_launch):
        assert blocks is None
    else:
        expected = align_by_expert(ids, experts, BLOCK_M)
        for field in ("sorted_slots", "block_expert", "num_rows"):
            assert torch.equal(getattr(blocks, field), getattr(expected, field)), field
    again = route_triton_with_logits(h, weight, top_k, True, counter, BLOCK_M, one_launch=one_launch)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids) and torch.equal(again[3], logits)


@pytest.mark.parametrize("one_launch", [None, True], ids=["default path", "one launch"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_batch_invariant(shape, one_launch):
    _, _, top_k = SHAPES[shape]
    h, weight = inputs(shape, 32, seed=7)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    batch = route_triton_with_logits(h, weight, top_k, True, counter, BLOCK_M, one_launch=one_launch)
    for t in (0, 13, 31):
        alone = route_triton_with_logits(h[t:t + 1], weight, top_k, True, counter, BLOCK_M)
        for i in (0, 1, 3):
            assert torch.equal(alone[i][0], batch[i][t]), (t, i)


@pytest.mark.parametrize("tokens", [1, 2])  # one launch with its grouping; 2: two launches, no grouping
def test_in_a_cuda_graph(tokens):
    experts, _, top_k = SHAPES["qwen3-30b-a3b"]
    static_h, weight = inputs("qwen3-30b-a3b", tokens, seed=1)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    graph, (weights, ids, blocks) = capture_cuda_graph(
        lambda: route_triton(static_h, weight, top_k, True, counter, BLOCK_M))
    for seed in (2, 3):
        h, _ = inputs("qwen3-30b-a3b", tokens, seed=seed)
        static_h.copy_(h)
        graph.replay()
        eager_weights, eager_ids, eager_blocks = route_triton(h, weight, top_k, True, counter, BLOCK_M)
        assert torch.equal(weights, eager_weights) and torch.equal(ids, eager_ids)
        if not one_launch_taken(tokens, None):
            assert blocks is None and eager_blocks is None
            continue
        assert torch.equal(blocks.sorted_slots, eager_blocks.sorted_slots)
        assert torch.equal(blocks.block_expert, eager_blocks.block_expert)
    assert int(counter) == 0


def _routing_before(h: torch.Tensor, weight32: torch.Tensor, top_k: int) -> None:
    probs = torch.softmax(torch.nn.functional.linear(h.float(), weight32), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    align_by_expert_triton(ids.to(torch.int32), weight32.shape[0], BLOCK_M)


def route_and_group(h: torch.Tensor, weight: torch.Tensor, top_k: int, counter: torch.Tensor) -> None:
    """The default routing with the slots grouped: by the one launch, else by the grouping launch."""
    _, ids, blocks = route_triton(h, weight, top_k, True, counter, BLOCK_M)
    if blocks is None:
        align_by_expert_triton(ids, weight.shape[0], BLOCK_M)


def test_timing_table():
    rows = []
    for shape in SHAPES:
        _, _, top_k = SHAPES[shape]
        for tokens in (1, 8, 32, 256):
            h, weight = inputs(shape, tokens, seed=tokens)
            weight32 = weight.float()
            counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
            before = median_us_per_call(lambda: _routing_before(h, weight32, top_k), 1)
            after = median_us_per_call(lambda: route_and_group(h, weight, top_k, counter), 1)
            rows.append(f"{shape:14s} T={tokens:4d}  routing before {before:7.1f} us  now {after:7.1f} us")
    print("\n" + "\n".join(rows))


# --- gpt-oss's router: a bias, softmax over the k chosen logits --------------------------------

GPT_OSS = {"gpt-oss-20b": (32, 2880, 4), "gpt-oss-120b": (128, 2880, 4)}  # (E, hidden, top_k)
GPT_OSS_WEIGHTS = dict(rtol=2e-6, atol=2e-6)


def gpt_oss_inputs(shape: str, tokens: int, seed: int, ties: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h, W, bias)`` in bf16: `inputs` at gpt-oss's shapes and a bias N(0, 1) (the tied
    experts share one value)."""
    experts, hidden, _ = GPT_OSS[shape]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, device=DEVICE)
    weight = torch.randn(experts, hidden, generator=g, device=DEVICE) / hidden ** 0.5
    bias = torch.randn(experts, generator=g, device=DEVICE)
    if ties:
        h += 1.0
        weight[list(TIED)] = 4.0 * torch.rand(hidden, generator=g, device=DEVICE) / hidden ** 0.5
        bias[list(TIED)] = 1.0
    return h.bfloat16(), weight.bfloat16(), bias.bfloat16()


GPT_OSS_CASES = ([(s, t, False, p) for t in TOKENS for s, p in paths(GPT_OSS, t)]
                 + [(s, 32, True, p) for s, p in paths(GPT_OSS, 32)])


@pytest.mark.parametrize("shape,tokens,ties,one_launch", GPT_OSS_CASES)
def test_gpt_oss_against_torch_reference(shape, tokens, ties, one_launch):
    experts, _, top_k = GPT_OSS[shape]
    h, weight, bias = gpt_oss_inputs(shape, tokens, seed=tokens, ties=ties)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    weights, ids, blocks, logits = route_triton_with_logits(h, weight, top_k, True, counter, BLOCK_M, bias,
                                                            one_launch=one_launch)
    assert int(counter) == 0
    torch.testing.assert_close(logits, router_logits_torch(h, weight, bias), rtol=1e-4, atol=1e-4)
    expected_weights, expected_ids = route_topk_softmax(logits, top_k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, **GPT_OSS_WEIGHTS)
    if ties:
        assert bool((ids[:, :len(TIED)] == torch.tensor(TIED, dtype=torch.int32, device=DEVICE)).all())
    if not one_launch_taken(tokens, one_launch):
        assert blocks is None
    else:
        expected = align_by_expert(ids, experts, BLOCK_M)
        for field in ("sorted_slots", "block_expert", "num_rows"):
            assert torch.equal(getattr(blocks, field), getattr(expected, field)), field
    again = route_triton_with_logits(h, weight, top_k, True, counter, BLOCK_M, bias, one_launch=one_launch)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids) and torch.equal(again[3], logits)


@pytest.mark.parametrize("shape", list(GPT_OSS))
def test_gpt_oss_batch_invariant(shape):
    """A token's bits alone (one launch), in a batch of 32 (two launches by default, and one asked
    for) and in a batch of 300 (two launches)."""
    _, _, top_k = GPT_OSS[shape]
    h, weight, bias = gpt_oss_inputs(shape, 300, seed=7)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    large = route_triton_with_logits(h, weight, top_k, True, counter, None, bias)
    batch = route_triton_with_logits(h[:32], weight, top_k, True, counter, BLOCK_M, bias)
    asked = route_triton_with_logits(h[:32], weight, top_k, True, counter, BLOCK_M, bias, one_launch=True)
    for t in (0, 13, 31):
        alone = route_triton_with_logits(h[t:t + 1], weight, top_k, True, counter, BLOCK_M, bias)
        for i in (0, 1, 3):
            assert torch.equal(alone[i][0], batch[i][t]) and torch.equal(large[i][t], batch[i][t]), (t, i)
            assert torch.equal(asked[i][t], batch[i][t]), (t, i)


@pytest.mark.parametrize("tokens", [1, 32])
def test_gpt_oss_router_module_in_a_cuda_graph(tokens):
    """`GptOssRouter.forward` on CUDA is `route_triton` with its bias (the same bits: one launch at 1
    token, two at 32), captured and replayed with new inputs."""
    experts, hidden, top_k = GPT_OSS["gpt-oss-20b"]
    static_h, weight, bias = gpt_oss_inputs("gpt-oss-20b", tokens, seed=1)
    router = GptOssRouter(hidden, experts, top_k, torch.bfloat16, DEVICE)
    router.weight.data.copy_(weight)
    router.bias.data.copy_(bias)
    graph, (weights, ids) = capture_cuda_graph(lambda: router(static_h))
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for seed in (2, 3):
        h, _, _ = gpt_oss_inputs("gpt-oss-20b", tokens, seed=seed)
        static_h.copy_(h)
        graph.replay()
        direct_weights, direct_ids, _ = route_triton(h, weight, top_k, True, counter, bias=bias)
        assert torch.equal(weights, direct_weights) and torch.equal(ids, direct_ids)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert int(router._counter) == 0


def _gpt_oss_routing_before(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
    """gpt-oss's routing before the Triton router: fp32 copies of W and b on every call, the fp32
    linear, a sort, a gather, a softmax and an int cast."""
    logits = torch.nn.functional.linear(h.float(), weight.float(), bias.float())
    route_topk_softmax(logits, top_k)


def test_gpt_oss_timing_table():
    rows = []
    for shape, (experts, hidden, top_k) in GPT_OSS.items():
        router = GptOssRouter(hidden, experts, top_k, torch.bfloat16, DEVICE)
        for tokens in (1, 8, 32, 256):
            h, weight, bias = gpt_oss_inputs(shape, tokens, seed=tokens)
            router.weight.data.copy_(weight)
            router.bias.data.copy_(bias)
            before = median_us_per_call(lambda: _gpt_oss_routing_before(h, weight, bias, top_k), 1)
            after = median_us_per_call(lambda: router(h), 1)
            rows.append(f"{shape:14s} T={tokens:4d}  routing before {before:7.1f} us  now {after:7.1f} us")
    print("\n" + "\n".join(rows))
