"""Timing the Triton attention kernels (or any function of the same signature) on one GPU, on
random bf16 inputs in scattered KV-cache slots: decode as it runs in the engine (a CUDA graph
of many calls), extend eagerly (prefill is not captured)."""
from __future__ import annotations

import functools
import statistics
from typing import Callable, Optional

import torch

from arfusion.fusion.tuning.timing import median_us_per_call
from arfusion.layers.kernels.triton_decode_attention import decode_attention
from arfusion.layers.kernels.triton_extend_attention import extend_attention

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
ExtendAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              float], torch.Tensor]


def time_decode_attention(batch: int, context: int, num_heads: int = 16, num_kv_heads: int = 4, head_dim: int = 128,
                          dtype: torch.dtype = torch.bfloat16, attention_fn: AttentionFn = decode_attention,
                          calls_per_graph: int = 32, repeats: int = 10, seed: int = 0) -> float:
    """Microseconds per call of ``attention_fn(q, k_cache, v_cache, req_to_token, seq_lens, scale)``
    (default: ``decode_attention``) at full context (every row attends to ``context`` keys in
    scattered slots), on the current CUDA device.

    One CUDA graph of ``calls_per_graph`` calls is captured and replayed ``repeats`` times, each
    replay timed with CUDA events; returns the median / calls_per_graph. The calls cycle over
    several K/V caches (like a model's layers) so that, together, they exceed the L2 cache."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    slots = batch * context
    cache_bytes = 2 * slots * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    num_caches = max(1, min(calls_per_graph, -(-256 * 2**20 // cache_bytes)))
    caches = [(torch.randn(slots, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype),
               torch.randn(slots, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype))
              for _ in range(num_caches)]
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    req_to_token = torch.randperm(slots, generator=gen, device=device).view(batch, context)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    scale = head_dim ** -0.5

    def calls() -> None:
        for i in range(calls_per_graph):
            k, v = caches[i % num_caches]
            attention_fn(q, k, v, req_to_token, seq_lens, scale)

    return median_us_per_call(calls, calls_per_graph, warmup=1, trials=repeats)


def time_extend_attention(prefix_lens: list[int], extend_lens: list[int], num_heads: int = 16, num_kv_heads: int = 4,
                          head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                          attention_fn: Optional[ExtendAttentionFn] = None, calls: int = 8, repeats: int = 10,
                          seed: int = 0) -> float:
    """Microseconds per eager call of ``attention_fn(q, k_cache, v_cache, req_to_token, seq_lens,
    extend_lens, scale)`` (default: ``extend_attention`` given ``max_extend_len``, so without a
    host sync) on the current CUDA device, for sequences of ``prefix_lens[i]`` cached and
    ``extend_lens[i]`` new tokens in scattered slots.

    Eager, not a CUDA graph: prefill runs eagerly in the engine, and a per-sequence torch loop
    that reads its lengths on the host cannot be captured. After one warm-up call (compilation),
    ``repeats`` trials of ``calls`` back-to-back calls are timed with CUDA events; returns the
    median / calls."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens_list = [p + e for p, e in zip(prefix_lens, extend_lens)]
    batch, context, tokens = len(seq_lens_list), max(seq_lens_list), sum(extend_lens)
    num_slots = batch * context
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    req_to_token = torch.randperm(num_slots, generator=gen, device=device).view(batch, context)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int64, device=device)
    extend = torch.tensor(extend_lens, dtype=torch.int64, device=device)
    scale = head_dim ** -0.5
    if attention_fn is None:
        attention_fn = functools.partial(extend_attention, max_extend_len=max(extend_lens))

    def run() -> None:
        for _ in range(calls):
            attention_fn(q, k_cache, v_cache, req_to_token, seq_lens, extend, scale)

    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(samples)
