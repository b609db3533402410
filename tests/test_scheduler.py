"""Scheduler behaviour with a fake model: continuous batching, limits, and failing loudly."""
import threading
import time

import pytest

from arfusion.engine.common.generation import EngineError
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling import step_sampler as step_sampler_module
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.scheduler import Scheduler
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.fake_runner import FakeRunner, collect, serve_all

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
    assert s.policy.slots.available == runner.num_kv_slots - 1 and s.policy.rows.available == 2, "all KV slots freed"


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


def test_a_failing_step_reports_once_then_fails_every_request_with_a_500():
    failures = []
    s = Scheduler(FakeRunner(fail_at=2), build_tiny_tokenizer(), max_prefill_tokens=64, on_failure=failures.append)
    chunks, emit = collect()
    s.submit(Request([1, 2], SamplingParams(max_tokens=8, temperature=0), emit=emit))
    thread = threading.Thread(target=s.run_forever)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and not s.alive
    assert isinstance(chunks[-1], EngineError) and chunks[-1].status == 500
    assert "injected forward failure" in chunks[-1].message
    assert len(failures) == 1 and "injected forward failure" in failures[0]
    with pytest.raises(RuntimeError, match="scheduler has stopped"):
        s.submit(Request([1], SamplingParams(max_tokens=1), emit=emit))


def test_a_fused_reduction_that_gave_up_on_a_peer_fails_the_step_before_its_tokens_are_used():
    from arfusion.fusion import FusionTimeoutError

    runner, failures = FakeRunner(), []

    def timed_out() -> None:
        if runner.calls >= 2:  # the second step's kernel gave up on a stalled peer
            raise FusionTimeoutError("lamport_one_shot: rank 0 waited more than 1000 ms for rank 1's rows")

    runner.fusion.raise_if_failed = timed_out
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64, on_failure=failures.append)
    chunks, emit = collect()
    s.submit(Request([1, 2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), emit=emit))
    thread = threading.Thread(target=s.run_forever)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and not s.alive
    tokens = [t for c in chunks if not isinstance(c, EngineError) for t in c.token_ids]
    assert len(tokens) <= 1, "no token of the failed step (or later) reaches the client"
    assert isinstance(chunks[-1], EngineError) and chunks[-1].status == 500
    assert "FusionTimeoutError" in chunks[-1].message and "rank 1" in failures[0]


def test_a_stopped_scheduler_ends_the_requests_left_with_a_503():
    s = Scheduler(FakeRunner(), build_tiny_tokenizer(), max_prefill_tokens=64)
    (running, emit_running), (queued, emit_queued) = collect(), collect()
    s.submit(Request([1, 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), emit=emit_running))
    s._drain_inbox(block=False)
    s.step()
    s.submit(Request([3], SamplingParams(max_tokens=2), emit=emit_queued))  # still in the inbox
    s.stop()
    s.run_forever()
    assert [c.status for c in (running[-1], queued[-1])] == [503, 503]
    assert s.policy.slots.available == s.runner.num_kv_slots - 1 and not s.policy.running and not s.policy.waiting


def test_a_seed_that_cannot_seed_a_generator_is_refused_at_submit():
    s = Scheduler(FakeRunner(), build_tiny_tokenizer(), max_prefill_tokens=64)
    params = SamplingParams(max_tokens=2, temperature=1.0)
    object.__setattr__(params, "seed", 2**64)  # past SamplingParams' own check, as a bug elsewhere would be
    with pytest.raises(ValueError, match="seed 18446744073709551616"):
        s.submit(Request([1], params, emit=lambda c: None))


def _run_to_completion(s: Scheduler) -> None:
    s._drain_inbox(block=False)
    while s.step():
        pass


def test_a_request_whose_sampling_fails_fails_alone(monkeypatch: pytest.MonkeyPatch):
    """Sampling the batch raises because of one request's parameters (here: temperature 0.123):
    that request gets a 500, the greedy and the other sampled request finish, exactly as alone."""
    def picky_sample(step, params, generators, processed=None):
        if any(p.temperature == 0.123 for p in params):
            raise OverflowError("cannot sample this row")
        return real_sample(step, params, generators, processed)

    real_sample = step_sampler_module.sample
    requests = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=4, temperature=0.123, ignore_eos=True),
                SamplingParams(max_tokens=4, temperature=0.9, seed=3, ignore_eos=True)]
    alone = []
    for params in (requests[0], requests[2]):
        s = Scheduler(FakeRunner(rows=3), build_tiny_tokenizer(), max_prefill_tokens=64)
        chunks, emit = collect()
        s.submit(Request([1, 2, 3], params, emit=emit))
        _run_to_completion(s)
        alone.append([t for c in chunks for t in c.token_ids])
    monkeypatch.setattr(step_sampler_module, "sample", picky_sample)
    runner = FakeRunner(rows=3)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64)
    outs = [collect() for _ in requests]
    for params, (_, emit) in zip(requests, outs):
        s.submit(Request([1, 2, 3], params, emit=emit))
    _run_to_completion(s)
    good, bad, sampled = (chunks for chunks, _ in outs)
    assert len(bad) == 1 and bad[0].status == 500 and "cannot sample this row" in bad[0].message
    assert [t for c in good for t in c.token_ids] == alone[0]
    assert [t for c in sampled for t in c.token_ids] == alone[1], "the seeded request samples as if alone"
    assert s.alive and not s.policy.running and s.policy.slots.available == runner.num_kv_slots - 1


def test_a_request_whose_token_cannot_be_taken_in_fails_alone(monkeypatch: pytest.MonkeyPatch):
    release = Request.release

    def fragile_release(self, tokenizer):
        if self.params.stop == ("boom",):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return release(self, tokenizer)

    monkeypatch.setattr(Request, "release", fragile_release)
    runner = FakeRunner(rows=2)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64)
    (good, emit_good), (bad, emit_bad) = collect(), collect()
    s.submit(Request([1, 2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), emit=emit_good))
    s.submit(Request([1, 2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, stop=("boom",)),
                     emit=emit_bad))
    _run_to_completion(s)
    assert len(bad) == 1 and bad[0].status == 500 and "injected" in bad[0].message
    assert good[-1].finish_reason == "length" and good[-1].completion_tokens == 5
    assert s.alive and s.policy.slots.available == runner.num_kv_slots - 1 and s.policy.rows.available == 2


def _serve(overlap: bool, requests: list[tuple[list[int], SamplingParams]]) -> tuple[FakeRunner, Scheduler, list]:
    runner = FakeRunner(rows=3)
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64, overlap=overlap)
    return runner, s, serve_all(s, requests)


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
        assert not s.launched and not s.policy.running
        assert s.policy.slots.available == runner.num_kv_slots - 1 and s.policy.rows.available == 3, "all KV slots freed"
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
    assert s.policy.slots.available == runner.num_kv_slots - 1 and s.policy.rows.available == 2


class RecordingGroup:
    """A two-rank group on the CPU that only records what rank 0 broadcasts, and when."""

    world_size, rank = 2, 0

    def __init__(self) -> None:
        self.plans: list[str] = []
        self.times: list[float] = []

    def broadcast_object(self, obj, src=0):
        self.plans.append(obj.kind)
        self.times.append(time.monotonic())
        return obj


def test_an_idle_scheduler_sends_heartbeats_so_waiting_ranks_do_not_time_out():
    """Idle plans keep coming, never two within ``heartbeat_s`` (no busy loop); however slow the
    machine, only the wait for the third one is bounded (generously)."""
    heartbeat_s = 0.05
    runner = FakeRunner()
    runner.group = RecordingGroup()
    s = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64, heartbeat_s=heartbeat_s)
    thread = threading.Thread(target=s.run_forever)
    thread.start()
    deadline = time.monotonic() + 60
    while len(runner.group.plans) < 3 and time.monotonic() < deadline:
        time.sleep(heartbeat_s)
    s.stop()
    thread.join(timeout=60)
    plans, times = runner.group.plans, runner.group.times
    assert plans[-1] == "shutdown" and set(plans[:-1]) == {"idle"} and len(plans) >= 4, plans
    assert all(b - a >= heartbeat_s for a, b in zip(times[:-2], times[1:-1])), times
