"""Scheduler behaviour with a fake model: continuous batching, limits, and failing loudly."""
import threading
import types

import pytest
import torch

from engine.server.engine_client import GenerationChunk
from engine.scheduling.request import Request
from engine.runtime.sampler import StepLogits
from engine.scheduling.sampling_params import SamplingParams
from engine.scheduling.scheduler import Scheduler
from engine.runtime.step_plan import RequestTable
from engine.tokenizers.tokenizer import build_tiny_tokenizer
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
        self.inputs: list[list[int]] = []  # each step's input tokens
        self.gathered: list[bool] = []  # each step's plan.gather_logits
        self._rows = None

    def forward(self, plan):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected forward failure")
        batch, self._rows = self.table.apply(plan)
        self.inputs.append(batch.input_ids.tolist())
        self.batch_sizes.append((plan.kind, plan.batch_size))
        self.gathered.append(plan.gather_logits)
        logits = torch.zeros(plan.batch_size, VOCAB)
        for i, seq_len in enumerate(plan.seq_lens):
            logits[i, seq_len % 200 + 10] = 1.0
        return StepLogits(logits.argmax(-1), logits if plan.gather_logits else None)

    def commit_tokens(self, tokens):
        self.table.commit_tokens(self._rows, tokens)
        return tokens


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


def test_only_steps_with_a_sampled_request_gather_the_logits():
    runner = FakeRunner(rows=2)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64)
    greedy, sampled = collect(), collect()
    s.submit(Request([1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), emit=greedy[1]))
    s._drain_inbox(block=False)
    s.step()  # the greedy request's prefill, alone
    s.submit(Request([4, 5], SamplingParams(max_tokens=2, temperature=0.8, seed=1, ignore_eos=True), emit=sampled[1]))
    s._drain_inbox(block=False)
    while s.step():
        pass
    assert greedy[0][-1].completion_tokens == 6 and sampled[0][-1].completion_tokens == 2
    # greedy prefill; sampled prefill; a decode of both; then the greedy request alone
    assert runner.gathered[:3] == [False, True, True] and not any(runner.gathered[3:]), runner.gathered


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


def _serve(overlap: bool, requests: list[tuple[list[int], SamplingParams]]) -> tuple[FakeRunner, Scheduler, list]:
    runner = FakeRunner(rows=3)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64, overlap=overlap)
    outs = [collect() for _ in requests]
    for (prompt, params), (_, emit) in zip(requests, outs):
        s.submit(Request(prompt, params, emit=emit))
    s._drain_inbox(block=False)
    while s.step():
        pass
    return runner, s, [chunks for chunks, _ in outs]


def test_overlap_gives_the_same_outputs_and_drops_one_token_per_early_finish():
    """The fake model's next token is (seq_len mod 200) + 10: prompt [1, 2, 3] gives 13, 14, 15, ...
    so stop token 15 ends a request after three tokens and stop string "\x11" after seven."""
    requests = [([1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
                ([1, 2, 3], SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[15])),
                ([4, 5], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["\x11"])),
                ([7], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)),
                ([8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    results = {overlap: _serve(overlap, requests) for overlap in (False, True)}
    plain, overlapped = ([(c[-1].finish_reason, [t for chunk in c for t in chunk.token_ids]) for c in results[o][2]]
                         for o in (False, True))
    assert plain == overlapped
    assert [reason for reason, _ in plain] == ["length", "stop", "stop", "length", "length"]
    assert plain[1][1] == [13, 14, 15] and plain[0][1] == [13, 14, 15, 16, 17, 18]
    for overlap, (runner, s, _) in results.items():
        assert not s.launched and not s.running
        assert s.slots.available == runner.num_kv_slots - 1 and s.rows.available == 3, "all KV slots freed"
        decode_rows = sum(bs for kind, bs in runner.batch_sizes if kind == "decode")
        if overlap:  # the stop-token and stop-string requests ran one step past their end
            assert decode_rows == sum(len(t) - 1 for _, t in plain) + 2
        else:
            assert decode_rows == sum(len(t) - 1 for _, t in plain)
    # each decode step's inputs are the requests' previous tokens, read on the device
    runner = results[True][0]
    assert runner.inputs[0] == [1, 2, 3, 1, 2, 3, 4, 5]  # prefill of the three that fit
    assert runner.inputs[1] == [13, 13, 12]


def test_overlap_never_launches_past_max_tokens_or_the_reserved_slots():
    """A request is launched at most max_tokens times in all (one prefill, max_tokens - 1 decode
    steps), so its last launched step writes the last reserved KV slot, with or without overlap."""
    requests = [([1, 2, 3], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for n in (1, 2, 5)]
    for overlap in (False, True):
        runner, s, outs = _serve(overlap, requests)
        assert [c[-1].completion_tokens for c in outs] == [1, 2, 5]
        assert sum(bs for kind, bs in runner.batch_sizes if kind == "decode") == 0 + 1 + 4


def test_an_abort_while_a_step_is_in_flight_drops_its_token():
    runner = FakeRunner(rows=2)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64, overlap=True)
    (chunks, emit), (other, emit_other) = collect(), collect()
    req = Request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), emit=emit)
    s.submit(req)
    s.submit(Request([4], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), emit=emit_other))
    s._drain_inbox(block=False)
    s.step()  # prefill launched, nothing taken in yet
    assert not chunks and req.tokens_in_flight == 1
    s.step()  # decode launched, prefill's tokens taken in
    assert [c.token_ids for c in chunks] == [[13]] and req.tokens_in_flight == 1
    s.abort(req.rid)
    s._drain_inbox(block=False)
    while s.step():
        pass
    assert [c.token_ids for c in chunks] == [[13]], "the in-flight token of an aborted request is dropped"
    assert other[-1].finish_reason == "length" and other[-1].completion_tokens == 3
    assert s.slots.available == runner.num_kv_slots - 1 and s.rows.available == 2
