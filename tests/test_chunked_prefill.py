"""Chunked, mixed prefill in the scheduler, with the fake model (the next token follows from a
sequence's length): step budgets, decodes riding along in every step, chunks that sample
nothing, outputs equal to the unchunked schedule with and without overlap, aborts, and the
``--chunked-prefill-size`` option."""
import pytest
import torch

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.request import Request
from arfusion.engine.scheduling.scheduler import Scheduler
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from arfusion.server_args import ServerArgs, ServerArgsError
from tests.fake_runner import FakeRunner, collect, serve_all, token_ids

CONTEXT = 160


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def scheduler(chunk: int, overlap: bool = True, rows: int = 4) -> Scheduler:
    runner = FakeRunner(rows=rows, slots=512, context_len=CONTEXT)
    return Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=64, overlap=overlap,
                     chunked_prefill_size=chunk)


def serve(s: Scheduler, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Every request's tokens; the scheduler ends idle with every KV slot free."""
    outs = serve_all(s, requests)
    assert not s.policy.running and not s.launched and s.policy.slots.available == s.runner.num_kv_slots - 1
    return [token_ids(chunks) for chunks in outs]


LONG_PROMPT = [200 + i % 50 for i in range(100)]  # the only prompt with ids >= 200
REQUESTS = [(list(range(1, 6)), greedy(9)), (list(range(50)), greedy(4)), (LONG_PROMPT, greedy(1)),
            (list(range(30)), greedy(12)), ([7], greedy(3))]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [8, 16, 100])
def test_chunked_outputs_equal_the_unchunked_ones_and_every_step_fits_the_chunk(chunk: int, overlap: bool):
    reference = serve(scheduler(-1, overlap=False), REQUESTS)
    s = scheduler(chunk, overlap)
    assert serve(s, REQUESTS) == reference
    budget = min(chunk, s.policy.max_prefill_tokens)
    assert s.policy.max_extend_tokens == budget
    plans = s.runner.plans
    assert all(sum(len(slots) for slots in p.new_slots) <= budget for p in plans if p.kind == "extend")
    assert any(p.kind == "extend" and p.tokens_on_device for p in plans), "decodes rode along with prefill chunks"
    assert any(p.kind == "decode" for p in plans), "steps without prompt tokens are plain decode steps (graphs)"
    long_prompt_steps = [p for p in plans if any(t >= 200 for tokens in p.new_tokens for t in tokens)]
    assert len(long_prompt_steps) >= len(LONG_PROMPT) // budget, "the long prompt is prefilled in chunks"


def test_running_requests_get_a_token_every_step_while_a_long_prompt_is_prefilled():
    s = scheduler(chunk=16, overlap=True)
    (short, emit_short), (long, emit_long) = collect(), collect()
    s.submit(Request([1, 2, 3], greedy(40), emit=emit_short))
    s._drain_inbox(block=False)
    s.step()
    s.step()
    s.submit(Request(list(range(120)), greedy(2), emit=emit_long))
    s._drain_inbox(block=False)
    counts = []
    while not long:  # until the long prompt's first token arrives
        s.step()
        counts.append(sum(len(c.token_ids) for c in short))
    assert len(counts) >= 120 // 16, "the long prompt was prefilled in chunks over several steps"
    assert all(b - a == 1 for a, b in zip(counts, counts[1:])), f"a step without the running request's token: {counts}"
    chunk_steps = [p for p in s.runner.plans if p.new_tokens and len(p.new_tokens[-1]) > 3]
    assert len(chunk_steps) == 120 // 15, "each step: the running request's decode and 15 prompt tokens"
    assert all(p.kind == "extend" and p.num_device_tokens == 1 and sum(len(x) for x in p.new_slots) == 16
               for p in chunk_steps)


def test_a_chunk_that_does_not_end_its_prompt_samples_nothing():
    """A seeded request with a temperature draws its generator once per output token, whatever
    the chunking; steps gather the logits only when a sampling row samples."""
    s = scheduler(chunk=10)
    params = SamplingParams(max_tokens=3, temperature=0.7, seed=11, ignore_eos=True)
    (chunks, emit) = collect()
    req = Request(list(range(35)), params, emit=emit)
    s.submit(req)
    s._drain_inbox(block=False)
    while s.step():
        pass
    expected = torch.Generator().manual_seed(11)
    for _ in range(3):
        torch.rand(1, generator=expected)
    assert torch.equal(req.generator.get_state(), expected.get_state()), "drawn once per output token"
    assert s.runner.gathered == [False, False, False, True, True, True]
    assert [len(p.new_tokens[0]) if p.new_tokens else 0 for p in s.runner.plans] == [10, 10, 10, 5, 0, 0]


def test_an_abort_in_the_middle_of_a_prompt_frees_its_slots_and_the_next_request_goes_on():
    s = scheduler(chunk=8)
    (aborted, emit_aborted), (other, emit_other) = collect(), collect()
    req = Request(list(range(60)), greedy(5), emit=emit_aborted)
    s.submit(req)
    s.submit(Request([4, 5, 6], greedy(3), emit=emit_other))
    s._drain_inbox(block=False)
    s.step()
    s.step()
    assert req.prefilled == 8 + 5 and not req.prefill_done, "step 2: the short prompt whole, then 5 of the long one"
    s.abort(req.rid)
    s._drain_inbox(block=False)
    while s.step():
        pass
    assert not aborted and other[-1].completion_tokens == 3
    assert s.policy.slots.available == s.runner.num_kv_slots - 1 and s.policy.rows.available == 4


def test_decodes_that_fill_the_chunk_leave_prefill_waiting_and_run_as_decode_steps():
    s = scheduler(chunk=3, rows=4)
    outs = [collect() for _ in range(4)]
    for i, (_, emit) in enumerate(outs):
        s.submit(Request([1, 2] if i < 3 else [9, 9, 9, 9], greedy(4), emit=emit))
    s._drain_inbox(block=False)
    while s.step():
        pass
    kinds = [(p.kind, p.batch_size, sum(len(x) for x in p.new_slots)) for p in s.runner.plans]
    assert all(tokens <= 3 for kind, _, tokens in kinds if kind == "extend"), kinds
    assert ("decode", 3, 3) in kinds, "three decodes fill the step: the waiting prompt waits"
    assert [c[-1].completion_tokens for c, _ in outs] == [4, 4, 4, 4]


@pytest.mark.parametrize("value,chunked", [(8192, True), (-1, False), (0, False), (1, True)])
def test_the_chunked_prefill_size_option(value: int, chunked: bool):
    assert ServerArgs().chunked_prefill_size == 8192
    args = ServerArgs.from_cli(["--chunked-prefill-size", str(value)])
    s = Scheduler(FakeRunner(), build_tiny_tokenizer(), args.max_prefill_tokens,
                  chunked_prefill_size=args.chunked_prefill_size)
    assert (s.policy.max_step_tokens is not None) == chunked
    with pytest.raises(ServerArgsError, match="--chunked-prefill-size"):
        ServerArgs.from_cli(["--chunked-prefill-size", "-2"])
