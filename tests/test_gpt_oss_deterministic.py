"""gpt-oss in batch-invariant mode on the CPU (``--deterministic``): a sequence's logits have the
same bits alone, batched with other sequences of other lengths, and with its prompt chunked;
fp32 and bf16, MXFP4 experts kept and dequantized, dummy weights of a tiny gpt-oss (window 4,
prompt 11 tokens, 8 experts top-4). One TP1 rank (gloo)."""
import pytest
import torch

from arfusion.engine.models.config import ModelConfig
from tests.dist_utils import make_fusion, run_distributed

TINY = ModelConfig(
    architecture="GptOssForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=64, vocab_size=300, rope_theta=150000.0,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
    attention_bias=True, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64, sliding_window=4,
    layer_types=("sliding_attention", "full_attention"), expert_format="mxfp4",
)
PROMPT, OTHERS, STEPS = list(range(3, 14)), [[7, 8, 9], list(range(40, 60))], 4


def _run(model, schedule: list[list[tuple[int, list[int]]]], seqs: int) -> dict[int, list[torch.Tensor]]:
    """Forward each step's (sequence, new tokens); every sequence's logits rows in order."""
    from arfusion.engine.models.forward_batch import ForwardBatch

    cache = model.allocate_kv_cache(128)
    free = list(range(128))
    slots: list[list[int]] = [[] for _ in range(seqs)]
    rows: dict[int, list[torch.Tensor]] = {s: [] for s in range(seqs)}
    for chunks in schedule:
        for s, new in chunks:
            slots[s].extend(free.pop() for _ in new)
        out = model(ForwardBatch.from_lists([new for _, new in chunks], [slots[s] for s, _ in chunks]), cache).gather()
        for i, (s, _) in enumerate(chunks):
            rows[s].append(out[i])
    return rows


def _worker(rank: int, world: int) -> dict:
    import dataclasses

    from arfusion.engine.models.registry import build_model
    from arfusion.engine.weights.dummy import dummy_weights
    from arfusion.layers.batch_invariant import batch_invariant_mode

    decode = [[100 + i] for i in range(STEPS)]
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for keep in (False, True):
            config = dataclasses.replace(TINY, keep_mxfp4=keep)
            model = build_model(config, make_fusion(config.hidden_size, dtype), dtype)
            model.load_weights(dummy_weights(config, seed=2, dtype=dtype))
            with batch_invariant_mode(True):
                alone = _run(model, [[(0, PROMPT)]] + [[(0, d)] for d in decode], 1)[0]
                batched = _run(model, [[(1, OTHERS[0]), (0, PROMPT), (2, OTHERS[1])]]
                               + [[(1, [5]), (0, d), (2, [6])] for d in decode], 3)[0]
                chunked = _run(model, [[(0, PROMPT[:5])], [(2, OTHERS[1]), (0, PROMPT[5:])]]
                               + [[(0, d), (2, [6])] for d in decode], 3)[0][1:]
            results[(str(dtype), keep)] = (alone, batched, chunked)
    return results


@pytest.mark.timeout(300)
def test_a_sequence_has_the_same_bits_alone_batched_and_chunked():
    for key, (alone, batched, chunked) in run_distributed(_worker, world_size=1, timeout_s=200)[0].items():
        for other, what in ((batched, "batched"), (chunked, "chunked")):
            assert len(other) == len(alone) == 1 + STEPS
            for step, (a, b) in enumerate(zip(alone, other)):
                assert torch.equal(a, b), f"{key} {what}: step {step} differs by {(a - b).abs().max()}"
