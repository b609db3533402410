"""An LM head with more rows than the tokenizer has ids (a padded vocabulary): the ids past the
tokenizer's are never sampled, greedy or with a temperature, at TP1 and TP2 (gloo; at TP2 they
fill rank 1's slice and part of rank 0's), and their log-probability is -inf; an id the
tokenizer lacks, should one reach the response, has the empty text instead of failing it."""
from __future__ import annotations

import functools

import pytest

from arfusion.engine.common.generation import TokenLogprob
from arfusion.engine.server.api.logprobs_format import TextOffsets, TokenTexts, chat_logprobs, completion_logprobs
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.timeout(300)
TOKENIZER_VOCAB = 100  # of the tiny model's 264 rows
PROMPT = [1, 40, 50, 60, 70, 80]
REQUESTS = [{"max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 5}] + [
    {"max_tokens": 12, "temperature": 1.5, "seed": seed, "ignore_eos": True} for seed in range(6)]


def _rank(rank: int, world_size: int, tokenizer_vocab: int | None) -> list[dict]:
    from arfusion.engine.common.sampling_params import SamplingParams
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.runtime.step_plan import StepPlan
    from arfusion.engine.scheduling.scheduler import Scheduler
    from arfusion.layers.parallel_state import get_tp_group
    from tests.fake_runner import serve_all, token_ids
    from tests.plan_follower import follow_plans

    settings = RunnerSettings(model_path="tiny", context_length=64, max_running_requests=8, kv_slots=1024,
                              tokenizer_vocab_size=tokenizer_vocab)
    runner = build_runner(settings, get_tp_group())
    try:
        if rank != 0:
            follow_plans(runner)
            return []
        scheduler = Scheduler(runner, build_tiny_tokenizer(), max_prefill_tokens=256)
        outs = serve_all(scheduler, [(PROMPT, SamplingParams(**kw)) for kw in REQUESTS])
        if world_size > 1:
            runner.group.broadcast_object(StepPlan("shutdown"))
        return [{"tokens": token_ids(chunks),
                 "top": [t for c in chunks for lp in c.logprobs or [] for t, _ in lp.top]} for chunks in outs]
    finally:
        runner.destroy()


@functools.lru_cache(maxsize=None)
def served(world_size: int, tokenizer_vocab: int | None) -> list[dict]:
    return run_distributed(_rank, world_size=world_size, args=(tokenizer_vocab,), timeout_s=240)[0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_ids_past_the_tokenizer_are_never_sampled(world_size: int):
    unmasked = [t for out in served(world_size, None) for t in out["tokens"]]
    assert max(unmasked) >= TOKENIZER_VOCAB, "the random model samples high ids when nothing masks them"
    outs = served(world_size, TOKENIZER_VOCAB)
    assert all(len(out["tokens"]) == 12 for out in outs)
    assert max(t for out in outs for t in out["tokens"] + out["top"]) < TOKENIZER_VOCAB


@pytest.mark.parametrize("chat", [False, True])
def test_an_id_the_tokenizer_lacks_has_the_empty_text(chat: bool):
    tokenizer = build_tiny_tokenizer()
    unknown = tokenizer.vocab_size + 5
    entries = [TokenLogprob(t, -1.0, ((unknown, -1.0), (65, -2.0))) for t in (65, unknown, 66)]
    texts = TokenTexts(tokenizer)
    if chat:
        content = chat_logprobs(texts, entries).content
        assert [(c.token, c.bytes) for c in content] == [("A", [65]), ("", []), ("B", [66])]
    else:
        offsets = TextOffsets()
        offsets.begin_text(0)
        lp = completion_logprobs(texts, offsets, [65, unknown, 66], entries, len("AB"))
        assert (lp.tokens, lp.text_offset) == (["A", "", "B"], [0, 1, 1])
