"""`StaticBatch`: a fixed set of sequences run through a `ModelRunner` without a scheduler
(every rank builds the same plans itself): for benchmarks and tests that step the model
directly, like SGLang's bench_one_batch."""
from __future__ import annotations

import torch

from engine.kv_pool import RowAllocator, SlotAllocator
from engine.model_runner import ModelRunner
from engine.step_plan import StepPlan


class StaticBatch:
    def __init__(self, runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> None:
        if len(prompts) > runner.max_rows:
            raise ValueError(f"{len(prompts)} sequences exceed the runner's {runner.max_rows} rows")
        self.runner = runner
        self.tokens = [list(p) for p in prompts]
        self.prompt_lens = [len(p) for p in prompts]
        rows, slots = RowAllocator(runner.max_rows), SlotAllocator(runner.num_kv_slots)
        self.rows = [rows.allocate() for _ in prompts]
        self.slots = []
        for p in prompts:
            taken = slots.allocate(len(p) + max_new_tokens)
            if taken is None:
                raise ValueError(f"the KV cache ({runner.num_kv_slots} slots) cannot hold this batch")
            self.slots.append(taken)

    def prefill(self) -> torch.Tensor:
        """Logits ``[B, vocab]`` after the whole prompts."""
        plan = StepPlan("extend", rows=self.rows, new_tokens=[list(t) for t in self.tokens],
                        new_slots=[s[: len(t)] for s, t in zip(self.slots, self.tokens)],
                        seq_lens=[len(t) for t in self.tokens])
        return self.runner.forward(plan)

    def decode(self, next_tokens: list[int]) -> torch.Tensor:
        """Append one token per sequence and return the logits after it."""
        for seq, tok in zip(self.tokens, next_tokens):
            seq.append(tok)
        plan = StepPlan("decode", rows=self.rows, new_tokens=[[t] for t in next_tokens],
                        new_slots=[[s[len(t) - 1]] for s, t in zip(self.slots, self.tokens)],
                        seq_lens=[len(t) for t in self.tokens])
        return self.runner.forward(plan)


def random_prompts(batch_size: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The same random prompts on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, length), generator=g).tolist()
