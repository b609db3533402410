"""Where the decode attention's arrival counter lives and how it reaches the kernel: the KV cache
owns one zeroed int32 counter of ``max_decode_batch * num_kv_heads`` entries (a runner's sized
for its ``max_running_requests``), every layer's attention passes it to its decode call, and
`Attention` hands it to the Triton kernel only when it covers the batch (else the two-launch
path). CPU only: the Triton call is replaced by a recorder."""
import dataclasses

import pytest
import torch

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.forward_batch import ForwardBatch, KVCache
from arfusion.layers.attention import Attention
from tests.dist_utils import run_distributed

HEADS, KV_HEADS, DIM = 4, 2, 16
CONFIG = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=264, rope_theta=10000.0)


def test_kv_cache_owns_a_zeroed_counter_for_its_largest_decode_batch():
    cache = KVCache.allocate(16, 2, KV_HEADS, DIM, torch.float32, max_decode_batch=5)
    counter = cache.decode_counter
    assert counter.dtype == torch.int32 and counter.shape == (5 * KV_HEADS,) and not counter.any()
    assert KVCache.allocate(16, 2, KV_HEADS, DIM, torch.float32).decode_counter is None
    with pytest.raises(ValueError, match="max_decode_batch must be >= 0"):
        KVCache.allocate(16, 2, KV_HEADS, DIM, torch.float32, max_decode_batch=-1)


def _decode_batch(lens: list[int]) -> ForwardBatch:
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return ForwardBatch.from_lists([[1]] * len(lens), [slots[s:s + n] for s, n in zip(starts, lens)])


@pytest.mark.parametrize("entries,passed", [(6, True), (9, True), (5, False), (None, False)])
def test_attention_passes_the_counter_only_when_it_covers_the_batch(monkeypatch, entries, passed):
    """3 sequences x 2 KV heads need 6 entries; fewer, or none: no counter (two launches)."""
    pytest.importorskip("triton")
    import arfusion.layers.kernels.triton_decode_attention as kernel

    seen = []

    def record(q, *args, counter=None, **kwargs):
        seen.append(counter)
        return torch.zeros_like(q)

    monkeypatch.setattr(Attention, "_uses_triton", lambda self, q: True)
    monkeypatch.setattr(kernel, "decode_attention", record)
    attn = Attention(HEADS, KV_HEADS, DIM, DIM ** -0.5)
    counter = None if entries is None else torch.zeros(entries, dtype=torch.int32)
    cache = KVCache.allocate(64, 1, KV_HEADS, DIM, torch.float32)
    q = torch.randn(3, HEADS * DIM)
    attn.attend(q, cache.k[0], cache.v[0], _decode_batch([4, 1, 9]), counter)
    assert len(seen) == 1 and (seen[0] is counter if passed else seen[0] is None)


def _layers_pass_the_cache_counter(rank: int, world_size: int) -> dict:
    """A runner's KV cache (max_running_requests 3) and the counter each layer's decode got, for
    its tiny Llama; then a Qwen3 model on a cache of its own."""
    from arfusion.engine.models.registry import build_model
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.layers.parallel_state import get_tp_group
    from tests.dist_utils import make_fusion

    seen = []
    decode = Attention._decode

    def record(self, q, k_cache, v_cache, batch, decode_counter=None):
        seen.append(decode_counter)
        return decode(self, q, k_cache, v_cache, batch, decode_counter)

    Attention._decode = record
    results = {}
    runner = build_runner(RunnerSettings(model_path="tiny", context_length=64, max_running_requests=3, kv_slots=256),
                          get_tp_group())
    try:
        counter = runner.kv_cache.decode_counter
        results["runner counter"] = (counter.dtype, tuple(counter.shape), int(counter.count_nonzero()))
        results["runner kv heads"] = runner.model.num_kv_heads_local
        runner.model(_decode_batch([5, 2, 3]), runner.kv_cache)
        results["runner layers"] = [c is counter for c in seen]
    finally:
        runner.destroy()
    seen.clear()
    model = build_model(dataclasses.replace(CONFIG, architecture="Qwen3ForCausalLM"), make_fusion(CONFIG.hidden_size))
    cache = model.allocate_kv_cache(64, max_decode_batch=4)
    model(_decode_batch([5, 2, 3]), cache)
    results["qwen3 layers"] = [c is cache.decode_counter for c in seen]
    return results


@pytest.mark.timeout(300)
def test_every_layer_gets_the_kv_cache_counter():
    results = run_distributed(_layers_pass_the_cache_counter, world_size=1)[0]
    assert results["runner counter"] == (torch.int32, (3 * results["runner kv heads"],), 0)
    assert results["runner layers"] == [True] * 4  # the tiny model's layers
    assert results["qwen3 layers"] == [True] * CONFIG.num_hidden_layers
