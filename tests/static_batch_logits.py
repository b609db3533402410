"""Logits of a `StaticBatch` over a whole generation, for the GPU tests that compare two runs of
a model (TP sizes, fusion strategies): the model's own greedy stream, and the same stream
teacher-forced through another runner."""
from typing import Optional

import torch


def batch_logits(runner, prompts: list[list[int]], steps: int,
                 tokens: Optional[list[list[int]]] = None) -> tuple[torch.Tensor, list[list[int]]]:
    """``([steps + 1, B, vocab] logits, token stream)``: the prefill's logits, then one decode
    step's per step (each copied). ``tokens`` None: each step decodes the previous logits' argmax
    (the runner's own greedy stream, returned); else step ``i`` decodes ``tokens[i]``."""
    from arfusion.engine.scheduling.static_batch import StaticBatch

    batch = StaticBatch(runner, prompts, steps + 1)
    out = [batch.prefill(gather_logits=True).full.clone()]
    stream = tokens if tokens is not None else [out[-1].argmax(-1).tolist()]
    for step in range(steps):
        out.append(batch.decode(stream[step], gather_logits=True).full.clone())
        if tokens is None:
            stream.append(out[-1].argmax(-1).tolist())
    return torch.stack(out), stream
