"""Log-probabilities, echo, logit_bias, min_tokens and penalties with the real tiny model at TP1
and TP2 (gloo), through the scheduler (chunked prefill, overlap) and the HTTP app: a
log-likelihood request as evaluation harnesses send it; prompt log-probabilities equal to the
full-vocabulary log-softmax of a reference forward (fp32) and equal at TP1 and TP2; the greedy
token is the most likely of its alternatives; a -100 bias removes a token from the greedy
output and +100 forces one; min_tokens delays EOS and stop tokens; greedy decoding with
penalties picks, at every step, the argmax of a plain torch reference of vLLM's penalties."""
from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.timeout(300)
PROMPT_IDS = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(3)).tolist()
PROMPT_TEXT = "The capital of France is"
CHUNK = 16  # the 37-token prompt is prefilled in three chunks
EOS = 257  # <|end_of_text|> of the tiny tokenizer


def harness(prompt: Any, logprobs: int = 1, max_tokens: int = 1) -> dict:
    """A log-likelihood request as lm-eval-harness sends it."""
    return {"prompt": prompt, "echo": True, "logprobs": logprobs, "max_tokens": max_tokens, "temperature": 0}


HTTP = {"ids": harness(PROMPT_IDS), "text": harness(PROMPT_TEXT), "scored": harness(PROMPT_IDS, 5, 0),
        "greedy": {"prompt": PROMPT_TEXT, "max_tokens": 4, "temperature": 0, "logprobs": 3}}


def penalties(**kw: Any) -> dict:
    return {"max_tokens": 10, "temperature": 0, "ignore_eos": True, **kw}


PENALTIES = [penalties(repetition_penalty=1.8), penalties(frequency_penalty=1.5, presence_penalty=0.7),
             penalties(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=1.1),
             penalties(repetition_penalty=1.3, presence_penalty=2.0, logit_bias=((32, 5.0),))]


def _serve_http(runner: Any, tokenizer: Any) -> dict:
    """The HTTP requests against the real engine (scheduler thread on rank 0)."""
    from fastapi.testclient import TestClient

    from arfusion.engine.scheduling.scheduler import Scheduler
    from arfusion.engine.server.api import build_app
    from arfusion.engine.server.engine import Engine

    scheduler = Scheduler(runner, tokenizer, max_prefill_tokens=256, chunked_prefill_size=CHUNK)
    thread = threading.Thread(target=scheduler.run_forever, daemon=True)
    thread.start()
    try:
        client = TestClient(build_app(Engine(scheduler, tokenizer, "tiny", runner.context_len, runner.clear_fusion_cache, info=dict),
                                            "tiny"))
        return {name: client.post("/v1/completions", json=body).json() for name, body in HTTP.items()}
    finally:
        scheduler.stop()  # at TP2 its thread's last plan is "shutdown"
        thread.join(timeout=60)


def _serve_direct(runner: Any, tokenizer: Any, requests: list[tuple[list[int], dict]]) -> list[dict]:
    """Every request submitted at once to a scheduler stepped here; each one's tokens and finish."""
    from arfusion.engine.common.sampling_params import SamplingParams
    from arfusion.engine.scheduling.scheduler import Scheduler
    from tests.fake_runner import serve_all, token_ids

    scheduler = Scheduler(runner, tokenizer, max_prefill_tokens=256, chunked_prefill_size=CHUNK)
    outs = serve_all(scheduler, [(prompt, SamplingParams(**kw)) for prompt, kw in requests])
    assert not scheduler.policy.running and scheduler.policy.slots.available == runner.num_kv_slots - 1
    return [{"tokens": token_ids(chunks), "finish": chunks[-1].finish_reason} for chunks in outs]


def _all_position_logits(runner: Any, seq: list[int]) -> torch.Tensor:
    """Collective: fp32 ``[len(seq), V]`` raw logits of every position, one unchunked forward."""
    from arfusion.engine.models.forward_batch import ForwardBatch
    from arfusion.layers.sharded_logits import gather_vocab

    batch = ForwardBatch.from_lists([seq], [list(range(1, len(seq) + 1))])
    hidden = runner.model.hidden_states(batch, runner.kv_cache)
    return gather_vocab(runner.model.lm_head.local_logits(hidden))


def _rank(rank: int, world_size: int) -> dict:
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
    from arfusion.layers.parallel_state import get_tp_group
    from tests.plan_follower import follow_plans

    runner = build_runner(RunnerSettings(model_path="tiny", context_length=256, max_running_requests=8,
                                        kv_slots=1024), get_tp_group())
    tokenizer = build_tiny_tokenizer()
    out: dict = {}
    try:
        if rank == 0:
            prompt = PROMPT_IDS[:12]
            base = _serve_direct(runner, tokenizer, [(prompt, penalties())])[0]["tokens"]
            banned = max(set(base), key=base.count)
            out["base"], out["banned"] = base, banned
            direct = [(prompt, penalties(logit_bias=((banned, -100.0),))),
                      (prompt, penalties(logit_bias=((65, 100.0),))),
                      (prompt, {"max_tokens": 10, "temperature": 0, "logit_bias": ((EOS, 100.0),)}),
                      (prompt, {"max_tokens": 10, "temperature": 0, "min_tokens": 5, "logit_bias": ((EOS, 100.0),)}),
                      (prompt, {"max_tokens": 10, "temperature": 0.9, "seed": 2, "min_tokens": 3,
                                "stop_token_ids": (66,), "logit_bias": ((66, 100.0),)})]
            direct += [(prompt, kw) for kw in PENALTIES]
            out["direct"] = _serve_direct(runner, tokenizer, direct)
            out["http"] = _serve_http(runner, tokenizer)
            seqs = [PROMPT_IDS] + [prompt + r["tokens"] for r in out["direct"][-len(PENALTIES):]]
            if world_size > 1:
                runner.group.broadcast_object(seqs)
        else:
            follow_plans(runner)
            seqs = runner.group.broadcast_object(None, src=0)
        out["reference"] = [_all_position_logits(runner, seq) for seq in seqs]
        return out
    finally:
        runner.destroy()


@functools.lru_cache(maxsize=None)
def results(world_size: int) -> dict:
    return run_distributed(_rank, world_size=world_size, timeout_s=240)[0]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", ["ids", "text"])
def test_a_log_likelihood_request_scores_every_echoed_token(world_size: int, name: str):
    body = results(world_size)["http"][name]
    choice, usage = body["choices"][0], body["usage"]
    lp = choice["logprobs"]
    n = usage["prompt_tokens"] + 1
    assert usage["completion_tokens"] == 1 and len(lp["tokens"]) == n
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(isinstance(d, dict) and 1 <= len(d) <= 2 for d in lp["top_logprobs"][1:])
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == value, "the chosen token is among its alternatives"
    assert all(choice["text"][o:o + len(t)] == t for t, o in zip(lp["tokens"], lp["text_offset"]) if "bytes:" not in t)
    if name == "text":
        assert choice["text"].startswith(PROMPT_TEXT)
        assert (lp["tokens"][0], lp["text_offset"][0]) == ("", 0), "the BOS is not in the text"


@pytest.mark.parametrize("world_size", [1, 2])
def test_prompt_logprobs_are_the_full_vocabulary_log_softmax(world_size: int):
    r = results(world_size)
    lp = r["http"]["scored"]["choices"][0]["logprobs"]
    assert r["http"]["scored"]["usage"]["completion_tokens"] == 0 and len(lp["tokens"]) == len(PROMPT_IDS)
    logp = torch.log_softmax(r["reference"][0], dim=-1)  # row p scores prompt token p + 1
    expected = logp[torch.arange(len(PROMPT_IDS) - 1), torch.tensor(PROMPT_IDS[1:])]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), expected, rtol=0, atol=1e-5)
    for p, top in enumerate(lp["top_logprobs"][1:]):
        best = logp[p].topk(5).values
        assert sorted(top.values(), reverse=True)[:5] == pytest.approx(best.tolist(), abs=1e-5)


def test_prompt_logprobs_agree_at_tp1_and_tp2():
    one, two = (results(w)["http"]["scored"]["choices"][0]["logprobs"] for w in (1, 2))
    torch.testing.assert_close(torch.tensor(one["token_logprobs"][1:]), torch.tensor(two["token_logprobs"][1:]),
                               rtol=0, atol=1e-3)
    assert one["tokens"] == two["tokens"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_greedy_token_is_the_most_likely_alternative(world_size: int):
    greedy = results(world_size)["http"]["greedy"]["choices"][0]["logprobs"]
    harness = results(world_size)["http"]["ids"]["choices"][0]["logprobs"]
    generated = list(zip(greedy["tokens"], greedy["token_logprobs"], greedy["top_logprobs"]))
    generated.append((harness["tokens"][-1], harness["token_logprobs"][-1], harness["top_logprobs"][-1]))
    assert len(generated) == 5 and all(len(top) == 3 for _, _, top in generated[:4])
    for token, value, top in generated:
        assert value == max(top.values()) and max(top, key=top.get) == token


@pytest.mark.parametrize("world_size", [1, 2])
def test_logit_bias_and_min_tokens_steer_greedy_decoding(world_size: int):
    r = results(world_size)
    banned, forced, eos_now, eos_later, stop_later = r["direct"][:5]
    assert r["banned"] in r["base"] and r["banned"] not in banned["tokens"] and len(banned["tokens"]) == 10
    assert forced["tokens"] == [65] * 10
    assert eos_now == {"tokens": [EOS], "finish": "stop"}
    assert len(eos_later["tokens"]) == 6 and EOS not in eos_later["tokens"][:5] and eos_later["tokens"][5] == EOS
    assert eos_later["finish"] == "stop"
    assert len(stop_later["tokens"]) == 4 and 66 not in stop_later["tokens"][:3] and stop_later["finish"] == "stop"


def _penalised(logits: torch.Tensor, prompt: list[int], output: list[int], kw: dict) -> torch.Tensor:
    """vLLM's penalties on one row of raw logits, token by token."""
    x = logits.clone()
    for t, b in kw.get("logit_bias", ()):
        x[t] += b
    rep = kw.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= kw.get("frequency_penalty", 0.0) * output.count(t) + kw.get("presence_penalty", 0.0)
    return x


@pytest.mark.parametrize("world_size", [1, 2])
def test_greedy_decoding_with_penalties_follows_the_reference(world_size: int):
    r = results(world_size)
    prompt = PROMPT_IDS[:12]
    for kw, out, logits in zip(PENALTIES, r["direct"][-len(PENALTIES):], r["reference"][1:]):
        tokens = out["tokens"]
        assert len(tokens) == 10 and tokens != r["base"], kw
        for j, token in enumerate(tokens):
            row = _penalised(logits[len(prompt) - 1 + j], prompt, tokens[:j], kw)
            assert row.argmax().item() == token, (kw, j)
