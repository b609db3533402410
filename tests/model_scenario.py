"""The model tests' scenario: three sequences of different lengths through one model and KV cache,
a prefill (one prompt chunked), a mixed step (a chunk after a cached prefix plus two decodes),
then greedy decode; every logits row with its (sequence, position), and the reductions it ran."""
from __future__ import annotations

from typing import Any

import torch

from arfusion.engine.models.forward_batch import ForwardBatch
from arfusion.layers.parallel_state import get_tp_group
from tests.dist_utils import AllReduceCounter, reductions

PROMPTS = [[5, 200, 17, 3, 99], [42, 7], [11, 250, 63, 8, 120, 77, 1, 30, 222]]


def run_scenario(model: Any, fusion: Any, num_slots: int, decode_steps: int) -> dict[str, Any]:
    """Rank-local (a collective per step over the TP group): ``logits`` [rows, vocab] fp32,
    ``rows`` (sequence, position) of each, ``tokens`` the sequences, ``forwards``,
    ``all_reduces`` over the group and ``fused`` (reductions of the fusion op not run as nccl)."""
    group = get_tp_group()
    cache = model.allocate_kv_cache(num_slots)
    free = torch.randperm(num_slots, generator=torch.Generator().manual_seed(7)).tolist()
    seqs = [list(p) for p in PROMPTS]
    slots: list[list[int]] = [[] for _ in PROMPTS]
    rows, logits = [], []
    counter = AllReduceCounter(group)
    fusion.counts.clear()

    def step(chunks: list[tuple[int, list[int]]]) -> list[int]:
        for s, new in chunks:
            slots[s].extend(free.pop() for _ in new)
        out = model(ForwardBatch.from_lists([new for _, new in chunks], [slots[s] for s, _ in chunks]), cache)
        full = out.gather()
        assert full.dtype == torch.float32 and full.shape == (len(chunks), model.config.vocab_size)
        assert out.greedy_tokens.tolist() == full.argmax(dim=-1).tolist(), "greedy over the shards = argmax of the whole"
        rows.extend((s, len(slots[s]) - 1) for s, _ in chunks)
        logits.append(full)
        return out.greedy_tokens.tolist()

    first = step([(0, seqs[0]), (1, seqs[1]), (2, seqs[2][:4])])
    for s in (0, 1):
        seqs[s].append(first[s])
    chunks = [(0, seqs[0][-1:]), (1, seqs[1][-1:]), (2, seqs[2][4:])]
    for _ in range(1 + decode_steps):
        for s, token in enumerate(step(chunks)):
            seqs[s].append(token)
        chunks = [(s, seqs[s][-1:]) for s in range(3)]
    return {"logits": torch.cat(logits), "rows": rows, "tokens": seqs, "forwards": len(logits),
            "all_reduces": reductions(counter, fusion), "fused": sum(n for s, n in fusion.counts.items() if s != "nccl")}
