"""Scheduler behaviour with a fake model: continuous batching, limits, and failing loudly."""
import threading
import types

import pytest
import torch

from engine.engine_client import GenerationChunk
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_plan import RequestTable
from engine.tokenizer import build_tiny_tokenizer
from fusion.group import TensorParallelGroup

VOCAB = 264


class FakeRunner:
    """Logits that always prefer token (position mod 200) + 10; optionally fails at step N."""

    def __init__(self, fail_at: int = -1, rows: int = 4, slots: int = 64) -> None:
        self.group = TensorParallelGroup(0, 1, torch.device("cpu"))
        self.num_kv_slots, self.max_rows, self.context_len = slots, rows, 32
        self.config = types.SimpleNamespace(eos_token_ids=())
        self.table = RequestTable(rows, self.context_len, torch.device("cpu"))
        self.fail_at, self.calls, self.batch_sizes = fail_at, 0, []

    def forward(self, plan):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected forward failure")
        self.table.apply(plan)
        self.batch_sizes.append((plan.kind, plan.batch_size))
        logits = torch.zeros(plan.batch_size, VOCAB)
        for i, seq_len in enumerate(plan.seq_lens):
            logits[i, seq_len % 200 + 10] = 1.0
        return logits


def collect() -> tuple[list[GenerationChunk], callable]:
    chunks: list[GenerationChunk] = []
    return chunks, chunks.append


def test_requests_join_and_leave_between_steps():
    runner = FakeRunner(rows=2)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64)
    outs = [collect() for _ in range(3)]
    for (chunks, emit), n in zip(outs, (3, 5, 2)):
        s.submit(Request([1, 2, 3], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), emit=emit))
    s._drain_inbox(block=False)
    while s.step():
        pass
    assert [c[-1].finish_reason for c, _ in outs] == ["length"] * 3
    assert [c[-1].completion_tokens for c, _ in outs] == [3, 5, 2]
    assert max(bs for _, bs in runner.batch_sizes) == 2, "max_running_requests (rows) bounds the batch"
    assert ("extend", 1) in runner.batch_sizes, "the third request joined while the others decoded"
    assert s.slots.available == runner.num_kv_slots - 1 and s.rows.available == 2, "all KV slots freed"


def test_a_request_that_can_never_fit_is_refused_with_numbers():
    s = Scheduler(FakeRunner(), build_tiny_tokenizer(), max_prefill_tokens=64)
    with pytest.raises(ValueError, match="exceeds the context length 32"):
        s.submit(Request([1] * 30, SamplingParams(max_tokens=5), emit=lambda c: None))


def test_a_failing_step_aborts_every_request_and_reports_once():
    failures = []
    s = Scheduler(FakeRunner(fail_at=2), build_tiny_tokenizer(), max_prefill_tokens=64, on_failure=failures.append)
    chunks, emit = collect()
    s.submit(Request([1, 2], SamplingParams(max_tokens=8, temperature=0), emit=emit))
    thread = threading.Thread(target=s.run_forever)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and not s.alive
    assert chunks[-1].finish_reason == "abort"
    assert len(failures) == 1 and "injected forward failure" in failures[0]
    with pytest.raises(RuntimeError, match="scheduler has stopped"):
        s.submit(Request([1], SamplingParams(max_tokens=1), emit=emit))
