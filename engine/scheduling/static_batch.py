"""`StaticBatch`: a fixed set of sequences run through a `ModelRunner` without a scheduler
(every rank builds the same plans itself): for benchmarks and tests that step the model
directly, like SGLang's bench_one_batch. Greedy decoding feeds each step's tokens to the next
on the device, as the server's scheduler does."""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

import torch

from arfusion.engine.scheduling.kv_pool import RowAllocator, SlotAllocator
from arfusion.engine.runtime.model_runner import ModelRunner
from arfusion.engine.scheduling.pending_tokens import PendingTokens
from arfusion.engine.runtime.sampler import StepLogits
from arfusion.engine.runtime.step_plan import StepPlan


class StaticBatch:
    def __init__(self, runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int) -> None:
        if len(prompts) > runner.max_rows:
            raise ValueError(f"{len(prompts)} sequences exceed the runner's {runner.max_rows} rows")
        self.runner = runner
        self.prompts = [list(p) for p in prompts]
        self.seq_lens = [len(p) for p in prompts]
        rows, slots = RowAllocator(runner.max_rows), SlotAllocator(runner.num_kv_slots)
        self.rows = [rows.allocate() for _ in prompts]
        self.slots = []
        for p in prompts:
            taken = slots.allocate(len(p) + max_new_tokens)
            if taken is None:
                need = sum(len(q) + max_new_tokens for q in prompts)
                raise ValueError(f"the KV cache ({runner.num_kv_slots} slots) cannot hold this batch: its "
                                 f"{len(prompts)} sequences of prompt + new tokens need {need} slots; lower the "
                                 "batch or the lengths, or give the cache more memory (--mem-fraction-static)")
            self.slots.append(taken)

    def prefill(self, gather_logits: bool = False) -> StepLogits:
        """The greedy tokens after the whole prompts (and the fp32 logits ``[B, vocab]`` with
        ``gather_logits``)."""
        plan = StepPlan("extend", rows=self.rows, new_tokens=self.prompts,
                        new_slots=[s[:len(p)] for s, p in zip(self.slots, self.prompts)], seq_lens=list(self.seq_lens),
                        gather_logits=gather_logits)
        return self.runner.forward(plan)

    def decode(self, next_tokens: Optional[list[int]] = None, gather_logits: bool = False) -> StepLogits:
        """Append one token per sequence and return the greedy tokens after it (and the logits
        with ``gather_logits``): ``next_tokens`` from the host, or (None) each sequence's token
        committed on the device by the last step (`ModelRunner.commit_tokens`), which needs no
        host sync."""
        self.seq_lens = [n + 1 for n in self.seq_lens]
        plan = StepPlan("decode", rows=self.rows, new_tokens=[] if next_tokens is None else [[t] for t in next_tokens],
                        new_slots=[[s[n - 1]] for s, n in zip(self.slots, self.seq_lens)], seq_lens=list(self.seq_lens),
                        tokens_on_device=next_tokens is None, gather_logits=gather_logits)
        return self.runner.forward(plan)

    def prefill_greedy(self) -> PendingTokens:
        """Prefill, then commit each sequence's argmax token (rank 0's, on every rank)."""
        return PendingTokens(self.runner.commit_tokens(self._greedy(self.prefill())))

    def decode_greedy(self, steps: int, overlap: bool = True) -> tuple[list[list[int]], list[float]]:
        """``steps`` greedy decode steps, each reading the tokens the last step committed on the
        device. Each step's tokens are taken to the host (as a server must, to detokenize and
        check stops) one step late with ``overlap`` (step n+1 is launched first), else right
        after its launch. Returns each step's tokens and the ``time.perf_counter()`` at which
        they arrived."""
        launched: deque[PendingTokens] = deque()
        tokens: list[list[int]] = []
        arrivals: list[float] = []
        for step in range(steps):
            launched.append(PendingTokens(self.runner.commit_tokens(self._greedy(self.decode()))))
            keep = 1 if overlap and step < steps - 1 else 0
            while len(launched) > keep:
                tokens.append(launched.popleft().get())
                arrivals.append(time.perf_counter())
        return tokens, arrivals

    def _greedy(self, logits: StepLogits) -> Optional[torch.Tensor]:
        """Rank 0's next tokens (argmax); other ranks receive them in `commit_tokens`."""
        return logits.greedy_tokens if self.runner.group.rank == 0 else None


def random_prompts(batch_size: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The same random prompts on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, length), generator=g).tolist()
