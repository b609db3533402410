"""Every documented OpenAI request field of /v1/completions and /v1/chat/completions (and the
vLLM extensions the server knows) is honoured, inert, or refused by name, never ignored.

Hypothesis draws request bodies over every field of both schemas, each at a value the server
can honour or at one it cannot, against the scripted `FakeEngine`. The test's own oracle says
what must happen: a body with a field this server cannot honour (or a cross-field conflict) gets
a 400 (a 404 for another model's name) whose message names every such field, and never reaches
the engine; any other body gets a 200 whose effects are all observable: the engine receives the
prompt and exactly the `SamplingParams` the fields ask for (bias clamped), the response streams
or not, carries usage, the echoed prompt, and one log-probability entry per token (with the
asked number of alternatives) as asked. Inert fields (labels, hints, tool settings without tools)
change nothing. A first test checks that the oracle covers every field the schemas declare;
a parametrized one that refusals and bad values say which field and why.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.server.api import build_app
from arfusion.engine.server.api.openai_fields import (
    CHAT_HONOURED, CHAT_LIMITED, COMPLETION_HONOURED, COMPLETION_LIMITED, EXTENSIONS_LIMITED, INERT,
)
from arfusion.engine.server.api.protocol import ChatCompletionRequest, CompletionRequest
from tests.fake_engine import BOS, FakeEngine

pytestmark = pytest.mark.timeout(300)
SERVED, CTX = "served", 128
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ABSENT = object()  # a field left out of the body

# limited fields: (values the server honours, values it must refuse); None is "the default"
LIMITED_VALUES: dict[str, tuple[list, list]] = {
    "n": ([None, 1], [2, "1"]),
    "best_of": ([None, 1], [3]),
    "suffix": ([None, ""], ["end"]),
    "tools": ([None, []], [[{"type": "function", "function": {"name": "f"}}]]),
    "tool_choice": ([None, "none"], ["auto", {"type": "function", "function": {"name": "f"}}]),
    "functions": ([None, []], [[{"name": "f"}]]),
    "function_call": ([None, "none"], ["auto"]),
    "response_format": ([None, {"type": "text"}], [{"type": "json_object"}]),
    "audio": ([None], [{"voice": "alloy", "format": "wav"}]),
    "modalities": ([None, ["text"]], [["text", "audio"]]),
    "prediction": ([None], [{"type": "content", "content": "x"}]),
    "reasoning_effort": ([None], ["low"]),
    "verbosity": ([None], ["high"]),
    "web_search_options": ([None], [{}]),
    "service_tier": ([None, "auto", "default"], ["flex"]),
    "store": ([None, False], [True]),
    "min_p": ([0.0], [0.2]), "use_beam_search": ([False], [True]), "length_penalty": ([1.0], [0.5]),
    "include_stop_str_in_output": ([False], [True]), "skip_special_tokens": ([True], [False]),
    "spaces_between_special_tokens": ([True], [False]), "truncate_prompt_tokens": ([None], [8]),
    "prompt_logprobs": ([None], [1]), "allowed_token_ids": ([None], [[1, 2]]), "bad_words": ([None, []], [["x"]]),
    "guided_json": ([None], [{}]), "guided_regex": ([None], ["a+"]), "guided_choice": ([None], [["a"]]),
    "guided_grammar": ([None], ["g"]), "structured_outputs": ([None], [{"json": {}}]),
    "return_tokens_as_token_ids": ([False], [True]),
}
INERT_VALUES: dict[str, list] = {
    "user": [None, "u-1"], "metadata": [None, {"k": "v"}], "safety_identifier": [None, "s"],
    "prompt_cache_key": [None, "k"], "parallel_tool_calls": [None, True, False],
}
PROMPTS = ["hello", [104, 105, 106], ["ab"], [[BOS, 120, 121]]]
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "yo"}]}],
    [{"role": "system", "content": "s", "name": "rules"}, {"role": "user", "content": "q", "name": "ann"},
     {"role": "assistant", "content": "a"}, {"role": "user", "content": "again"}],
]


EXTENSION_NAMES = ("min_p", "use_beam_search", "length_penalty", "include_stop_str_in_output", "skip_special_tokens",
                   "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
                   "bad_words", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "structured_outputs", "return_tokens_as_token_ids")  # vLLM's, not declared by the schemas


def weighted(absent: int, ok: list, other: list, other_weight: int = 1) -> st.SearchStrategy:
    """ABSENT ``absent`` times in ``absent + 4 + other_weight``, else a value of ``ok`` (4) or
    of ``other`` (``other_weight``), so that most bodies are valid and every value still comes."""
    choices = [st.just(ABSENT)] * absent + [st.sampled_from(ok)] * 4 + [st.sampled_from(other)] * other_weight
    return st.integers(0, len(choices) - 1).flatmap(lambda i: choices[i])


def optional(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.integers(0, 2).flatmap(lambda i: st.just(ABSENT) if i == 0 else values)


small = st.floats(-2, 2, allow_nan=False).map(lambda x: round(x, 3))
STRATEGIES: dict[str, st.SearchStrategy] = {  # every field the test knows, both endpoints
    "model": weighted(4, [None, SERVED], ["other-model"]),
    "prompt": st.sampled_from(PROMPTS),
    "messages": st.sampled_from(MESSAGES),
    "max_tokens": optional(st.integers(1, 6)),
    "max_completion_tokens": optional(st.integers(1, 6)),
    "temperature": optional(st.sampled_from([None, 0.0, 0.7, 1.3])),
    "top_p": optional(st.sampled_from([None, 0.3, 1.0])),
    "top_k": optional(st.sampled_from([None, -1, 1, 5])),
    "seed": optional(st.integers(-5, 5)),
    "stop": optional(st.sampled_from([None, "c", ["zz", "b"]])),
    "stop_token_ids": optional(st.lists(st.integers(0, 257), max_size=3)),
    "ignore_eos": optional(st.booleans()),
    "min_tokens": weighted(2, [0, 1], [3, 7]),
    "stream": optional(st.booleans()),
    "stream_options": optional(st.sampled_from([None, {"include_usage": True}, {"include_usage": False}])),
    "presence_penalty": optional(small), "frequency_penalty": optional(small),
    "repetition_penalty": optional(st.sampled_from([None, 0.5, 1.0, 1.7])),
    "logit_bias": optional(st.dictionaries(st.integers(0, 257).map(str), st.sampled_from([-150.0, -3.5, 0.0, 42, 150]),
                                           max_size=3)),
    "echo": optional(st.sampled_from([None, False, True])),
    "top_logprobs": weighted(1, [None, 0, 2, 20], [None]),
    **{name: optional(st.sampled_from(values)) for name, values in INERT_VALUES.items()},
    **{name: weighted(6, ok, refused) for name, (ok, refused) in LIMITED_VALUES.items()},
}
LOGPROBS = {COMPLETIONS: optional(st.sampled_from([None, 0, 1, 3])), CHAT: weighted(1, [True], [None, False], 2)}
ECHO_MAX_TOKENS = st.integers(0, 6)  # max_tokens 0 is for echo


def test_the_oracle_covers_every_declared_field():
    for schema, honoured, limited in ((CompletionRequest, COMPLETION_HONOURED, COMPLETION_LIMITED),
                                      (ChatCompletionRequest, CHAT_HONOURED, CHAT_LIMITED)):
        declared = set(schema.model_fields)
        classified = set(honoured) | set(INERT) | set(limited)
        assert declared <= classified, f"fields without a policy: {declared - classified}"
        assert declared >= set(honoured) | (set(limited) - set(EXTENSIONS_LIMITED)), "a policy for no field"
        assert declared - {"logprobs"} <= set(STRATEGIES), f"fields the fuzz never draws: {declared - set(STRATEGIES)}"
    assert set(EXTENSIONS_LIMITED) == set(EXTENSION_NAMES)


def bodies(url: str) -> st.SearchStrategy:
    """Bodies over every field the schema of ``url`` declares, and vLLM's extensions."""
    schema = ChatCompletionRequest if url == CHAT else CompletionRequest
    names = [n for n in schema.model_fields if n != "logprobs"] + list(EXTENSION_NAMES)
    fields = {name: STRATEGIES[name] for name in names}
    fields["logprobs"] = LOGPROBS[url]
    if url == COMPLETIONS:
        fields["max_tokens"] = optional(ECHO_MAX_TOKENS)
    return st.fixed_dictionaries(fields).map(lambda drawn: {k: v for k, v in drawn.items() if v is not ABSENT})


def sent_prompt(body: dict) -> Any:
    """A completions prompt, out of its one-element batch."""
    prompt = body["prompt"]
    return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else prompt


def prompt_ids(body: dict, fake: FakeEngine) -> list[int]:
    tok = fake.tokenizer
    if "messages" in body:
        turns = [{"role": "system" if m["role"] == "developer" else m["role"],
                  "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"]),
                  **({"name": m["name"]} if "name" in m else {})} for m in body["messages"]]
        return tok.encode(tok.apply_chat_template(turns), add_special_tokens=False)
    prompt = sent_prompt(body)
    return tok.encode(prompt) if isinstance(prompt, str) else list(prompt)


def expected(body: dict, fake: FakeEngine) -> tuple[int, list[str], Optional[SamplingParams]]:
    """(status, names the error must hold, the params the engine must receive)."""
    chat = "messages" in body
    if body.get("model") not in (None, SERVED):
        return 404, [body["model"]], None
    refused = [name for name, (ok, _) in LIMITED_VALUES.items() if name in body and body[name] not in ok]
    if refused:
        return 400, refused, None
    n_prompt = len(prompt_ids(body, fake))
    echo = bool(body.get("echo"))
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = CTX - n_prompt if chat else 16
    if max_tokens == 0 and not echo:
        return 400, ["max_tokens"], None
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        return 400, ["top_logprobs"], None
    if (body.get("min_tokens") or 0) > max_tokens:
        return 400, ["min_tokens"], None
    stop = body.get("stop")
    logprobs = body.get("logprobs")
    if chat:
        logprobs = (body.get("top_logprobs") or 0) if logprobs else None
    bias = tuple(sorted((int(k), max(-100.0, min(100.0, v))) for k, v in (body.get("logit_bias") or {}).items()))
    temperature = body.get("temperature")
    return 200, [], SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
        top_p=body.get("top_p") or 1.0, top_k=-1 if body.get("top_k") is None else body["top_k"],
        seed=body.get("seed"), stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(body.get("stop_token_ids") or ()), ignore_eos=bool(body.get("ignore_eos")),
        min_tokens=body.get("min_tokens") or 0, presence_penalty=body.get("presence_penalty") or 0.0,
        frequency_penalty=body.get("frequency_penalty") or 0.0,
        repetition_penalty=body.get("repetition_penalty") or 1.0, logit_bias=bias, logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None)


def answer(resp: Any, stream: bool) -> tuple[list[dict], Optional[dict]]:
    """The response's choices (one per event when streamed) and its usage."""
    if not stream:
        body = resp.json()
        return body["choices"], body["usage"]
    events = [json.loads(b[len("data: "):]) for b in resp.text.split("\n\n")[:-2]]
    assert resp.text.endswith("data: [DONE]\n\n")
    usage = [e["usage"] for e in events if e.get("usage")]
    return [c for e in events for c in e["choices"]], usage[0] if usage else None


FAKE = FakeEngine(context_length=CTX)
CLIENT = TestClient(build_app(FAKE, SERVED))


def check(url: str, body: dict) -> None:
    FAKE.requests.clear()
    status, names, params = expected(body, FAKE)
    resp = CLIENT.post(url, json=body)
    assert resp.status_code == status, (body, resp.text)
    if status != 200:
        message = resp.json()["error"]["message"]
        assert all(name in message for name in names), (names, message)
        assert FAKE.requests == [], "a refused request never reaches the engine"
        return
    (ids, got), = FAKE.requests
    assert ids == prompt_ids(body, FAKE) and got == params
    stream = bool(body.get("stream"))
    choices, usage = answer(resp, stream)
    assert resp.headers["content-type"].startswith("text/event-stream") == stream
    if stream:
        assert (usage is not None) == bool((body.get("stream_options") or {}).get("include_usage"))
    assert usage is None or usage["prompt_tokens"] == len(ids)
    completion_tokens = usage["completion_tokens"] if usage else None
    if url == CHAT:
        logprobs = [c["logprobs"] for c in choices if c.get("logprobs")]
        if params.logprobs is None:
            assert logprobs == []
        else:
            content = [t for lp in logprobs for t in lp["content"]]
            assert completion_tokens is None or len(content) == completion_tokens
            assert all(len(t["top_logprobs"]) == params.logprobs for t in content)
        return
    text = "".join(c["text"] for c in choices)
    if body.get("echo"):
        echoed = sent_prompt(body)
        assert text.startswith(echoed if isinstance(echoed, str) else FAKE.tokenizer.decode(ids))
    entries = [c["logprobs"] for c in choices if c["logprobs"]]
    if params.logprobs is None:
        assert entries == []
        return
    tokens = [t for e in entries for t in e["tokens"]]
    offsets = [o for e in entries for o in e["text_offset"]]
    assert offsets == sorted(offsets) and len(offsets) == len(tokens)
    if completion_tokens is not None:
        assert len(tokens) == completion_tokens + (len(ids) if body.get("echo") else 0)
    tops = [t for e in entries for t in e["top_logprobs"] if t is not None]
    assert all(1 <= len(t) <= params.logprobs + 1 for t in tops)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("url, body, fragments", [
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, ["logprobs must be in [0, 20]"]),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x1": 5}}, ["logit_bias keys must be token ids", "'x1'"]),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"258": 5}}, ["logit_bias: token id 258 is out of range"]),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 2.5}, ["presence_penalty must be in [-2, 2]"]),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0.0}, ["repetition_penalty must be > 0"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}, ["min_tokens must be in [0, max_tokens"]),
    (COMPLETIONS, {"prompt": "hi", "suffix": "end", "best_of": 2}, ["suffix (no insertion", "best_of (only"]),
    (COMPLETIONS, {"prompt": "hi", "min_p": 0.1, "use_beam_search": True}, ["min_p (", "use_beam_search (no beam"]),
    (CHAT, {"messages": HI, "top_logprobs": 2}, ["top_logprobs needs logprobs: true"]),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, ["top_logprobs must be in [0, 20]"]),
    (CHAT, {"messages": HI, "tools": [{"type": "function"}], "response_format": {"type": "json_object"}},
     ["tools (this server does no tool calling)", 'response_format (only {"type": "text"}']),
    (CHAT, {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, ["messages[0].role 'tool'"]),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["messages[0].content[0].type 'image_url' (text parts only)"]),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
     ["messages[0].tool_calls", "messages[0].content (missing)"]),
])
def test_a_refusal_names_the_field_and_why(url: str, body: dict, fragments: list[str]):
    FAKE.requests.clear()
    resp = CLIENT.post(url, json=body)
    assert resp.status_code == 400, resp.text
    assert all(f in resp.json()["error"]["message"] for f in fragments), resp.json()["error"]["message"]
    assert FAKE.requests == []


FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(bodies(COMPLETIONS))
def test_every_completions_field_is_honoured_or_refused_by_name(body: dict):
    check(COMPLETIONS, body)


@FUZZ
@given(bodies(CHAT))
def test_every_chat_field_is_honoured_or_refused_by_name(body: dict):
    check(CHAT, body)
