"""On one GPU: the decode attention that rotates its own query and writes the new key
(layers/kernels/triton_rotary_decode_attention.py) against the two launches it replaces
(`rotary_embedding_store_kv`, then `decode_attention`), bf16, at the attention shapes of
qwen3-30b-a3b (32 query heads over 4 kv heads of 128, per-head q/k norm), llama3-8b (32 over 8)
and gpt-oss (64 over 8 heads of 64, sinks, a 128-key window), batches 1, 8 and 32 over ragged
rows of up to 700 keys (raw q/k/v N(0, 1), norm weights 1 + N(0, 0.1)).

- The K and V caches after the call equal the pair's bit for bit (the same rotation with the
  same roundings; FMA contraction is off in both launches).
- The output is within rounding of the pair's: against an fp32 reference of the same rotated
  query and caches, its largest error is at most twice the pair's plus one bf16 ulp (the
  attention is compiled without FMA contraction, the split kernel with it).
- Deterministic: two calls the same bits; a CUDA graph captured once and replayed with other
  rows, positions and slots gives each replay's eager bits.

The tiny Llama and Qwen3-MoE (``tiny``, ``tiny-moe``) in bf16 at TP1 with CUDA graphs,
``rotary_into_attention`` off and on: the fused launch runs with it on only, and the greedy tokens
are the same, their logits within 2e-2 relative L2 at every step (the bf16 bound of
tests/gpu/test_cuda_graph_decode.py); a token may flip only at a near tie of the flag-off run
(`tests.fold_checks.steps_in_agreement`).
"""
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.fold_checks import flag_off_and_on, steps_in_agreement

pytest.importorskip("triton")

pytestmark = pytest.mark.gpus(1)

# name: (query heads, kv heads, head dim, head norm, sinks and a window of 128)
SHAPES = {"qwen3-30b-a3b": (32, 4, 128, True, False), "llama3-8b": (32, 8, 128, False, False),
          "gpt-oss": (64, 8, 64, False, True)}
CONTEXT = 700
BF16_ULP = 2.0 ** -7
MAX_REL_ERR = 2e-2
PROMPTS, PROMPT_LEN, STEPS = 4, 9, 12


def _case(shape: tuple, batch: int, seed: int) -> dict:
    from arfusion.layers.head_norm import HeadNorm
    from arfusion.layers.rotary_embedding import rope_inv_freq

    heads, kv_heads, dim, with_norm, with_sinks = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device="cuda")

    qkv = randn(batch, (heads + 2 * kv_heads) * dim).bfloat16()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    slots = batch * CONTEXT + 3
    seq_lens = torch.randint(1, CONTEXT + 1, (batch,), generator=g, device="cuda")
    free = torch.randperm(slots, generator=g, device="cuda")
    table = free[:batch * CONTEXT].view(batch, CONTEXT).contiguous()  # no slot in two rows
    return {"positions": seq_lens - 1, "q": q, "k": k, "v": v, "inv_freq": rope_inv_freq(dim, 10000.0).cuda(),
            "slot_mapping": table.gather(1, (seq_lens - 1)[:, None])[:, 0].contiguous(),
            "k_cache": randn(slots, kv_heads, dim).bfloat16(), "v_cache": randn(slots, kv_heads, dim).bfloat16(),
            "req_to_token": table, "seq_lens": seq_lens, "scale": dim ** -0.5,
            "head_norm": HeadNorm((1 + 0.1 * randn(dim)).bfloat16(), (1 + 0.1 * randn(dim)).bfloat16(), 1e-6)
            if with_norm else None,
            "sinks": randn(heads) if with_sinks else None, "window": 128 if with_sinks else 0}


def _pair(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from arfusion.layers.kernels.triton_decode_attention import decode_attention
    from arfusion.layers.kernels.triton_rotary import rotary_embedding_store_kv

    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    q = rotary_embedding_store_kv(c["positions"], c["q"], c["k"], c["v"], c["inv_freq"], c["slot_mapping"], k_cache,
                                  v_cache, head_norm=c["head_norm"])
    q = q.view(q.shape[0], -1, c["k_cache"].shape[2])
    out = decode_attention(q, k_cache, v_cache, c["req_to_token"], c["seq_lens"], c["scale"], sinks=c["sinks"],
                           window=c["window"])
    return q, out, k_cache, v_cache


def _fused(c: dict, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    from arfusion.layers.kernels.triton_rotary_decode_attention import decode_attention_rotary

    return decode_attention_rotary(c["positions"], c["q"], c["k"], c["v"], c["inv_freq"], c["slot_mapping"], k_cache,
                                   v_cache, c["req_to_token"], c["seq_lens"], c["scale"], head_norm=c["head_norm"],
                                   sinks=c["sinks"], window=c["window"])


def _reference(c: dict, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    from arfusion.layers.sink_attention import attend_with_sinks

    slots = c["req_to_token"]
    return attend_with_sinks(q.float(), k_cache[slots].float(), v_cache[slots].float(), c["seq_lens"] - 1,
                             scale=c["scale"], sinks=c["sinks"], window=c["window"]).float()


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_same_cache_bits_and_output_within_rounding(name, batch):
    c = _case(SHAPES[name], batch, seed=batch)
    q, expected, k_pair, v_pair = _pair(c)
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    out = _fused(c, k_cache, v_cache)
    assert torch.equal(k_cache, k_pair) and torch.equal(v_cache, v_pair)
    truth = _reference(c, q, k_pair, v_pair)
    pair_error = (expected.float() - truth).abs().max().item()
    error = (out.float() - truth).abs().max().item()
    assert error <= 2 * pair_error + BF16_ULP, (error, pair_error)
    again_k, again_v = c["k_cache"].clone(), c["v_cache"].clone()
    assert torch.equal(_fused(c, again_k, again_v), out)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_graph_replays_give_the_eager_bits(name):
    batch = 8
    c = _case(SHAPES[name], batch, seed=11)
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    _fused(c, k_cache, v_cache)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(c, k_cache, v_cache)
    for seed in range(5):
        new = _case(SHAPES[name], batch, seed=100 + seed)
        for key in ("positions", "q", "k", "v", "slot_mapping", "req_to_token", "seq_lens", "sinks"):
            if c[key] is not None:
                c[key].copy_(new[key])
        if c["head_norm"] is not None:
            for weight, new_weight in zip(c["head_norm"][:2], new["head_norm"][:2]):
                weight.copy_(new_weight)
        k_cache.copy_(new["k_cache"])
        v_cache.copy_(new["v_cache"])
        graph.replay()
        eager_k, eager_v = new["k_cache"].clone(), new["v_cache"].clone()
        eager = _fused(new, eager_k, eager_v)
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), seed


def _greedy(rank: int, world: int, model: str) -> dict:
    """Greedy runs with the flag off and on: tokens, logits per step, fused launches counted."""
    from arfusion.layers.kernels import triton_rotary_decode_attention as fused

    return flag_off_and_on(model, PROMPTS, PROMPT_LEN, STEPS, "rotary_into_attention", fused, "decode_attention_rotary",
                           seed=5, dtype="bfloat16", cuda_graph_max_bs=PROMPTS, kv_slots=1024)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_greedy_tokens_with_the_flag_on_and_off_under_cuda_graphs(model):
    result = run_distributed(_greedy, world_size=1, args=(model,), device_kind="cuda", timeout_s=500)[0]
    off, on = result[False], result[True]
    assert off["graphs"] and on["graphs"], "both runs replay CUDA graphs"
    assert off["calls"] == 0 and on["calls"] > 0, "the fused launch runs with the flag on only"
    compared = steps_in_agreement(off, on, MAX_REL_ERR)
    print(f"\nrotary into attention, {model}: greedy tokens equal over {compared} of {len(off['tokens'])} steps")
