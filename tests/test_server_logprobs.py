"""Log-probabilities and echo in OpenAI's response shapes (the HTTP layer against the scripted
`FakeEngine`, whose log-probabilities are `fake_logprob`): the completions legacy object, whole
and streamed chunk by chunk (the streamed pieces add up to the whole); the chat object; token
texts of partial UTF-8 characters and log-probabilities JSON cannot hold."""
import json
import math

import pytest
from fastapi.testclient import TestClient

from arfusion.engine.common.generation import TokenLogprob
from arfusion.engine.server.api import build_app
from arfusion.engine.server.api.logprobs_format import LOGPROB_FLOOR, TextOffsets, TokenTexts, chat_logprobs, completion_logprobs
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.fake_engine import BOS, EOS, FakeEngine, fake_logprob

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client() -> TestClient:
    return TestClient(build_app(FakeEngine(context_length=64), "served"))


def events(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(block[len("data: "):]) for block in text.split("\n\n")[:-2]]


def merged(choices: list[dict]) -> dict:
    """Streamed completions choices as one: texts joined, logprob lists concatenated."""
    parts = [c["logprobs"] for c in choices if c["logprobs"]]
    return {"text": "".join(c["text"] for c in choices),
            "logprobs": {key: [v for p in parts for v in p[key]] for key in parts[0]} if parts else None}


@pytest.mark.parametrize("echo, max_tokens", [(False, 3), (True, 2), (True, 0)])
@pytest.mark.parametrize("logprobs", [0, 2])
def test_completion_logprobs_whole_and_streamed(client: TestClient, echo: bool, max_tokens: int, logprobs: int):
    body = {"prompt": "abc", "max_tokens": max_tokens, "logprobs": logprobs, "echo": echo}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    prompt = [BOS, *b"abc"]
    output = list(b"cba")[:max_tokens]
    ids = (prompt if echo else []) + output
    expected = [None] * echo + [fake_logprob(t, logprobs) for t in (prompt[1:] if echo else []) + output]
    lp = whole["logprobs"]
    assert whole["text"] == ("abc" if echo else "") + bytes(output).decode()
    assert lp["tokens"] == ["" if t == BOS else chr(t) for t in ids], "BOS: not in the text"
    assert lp["token_logprobs"] == [e and e.logprob for e in expected]
    assert lp["top_logprobs"] == [e and {chr(t): v for t, v in (*e.top, (e.token_id, e.logprob))} for e in expected]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert all(whole["text"][o:o + len(t)] == t for t, o in zip(lp["tokens"], lp["text_offset"]))
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}).text)
    if echo:
        assert streamed[0]["choices"][0]["text"] == "abc", "the echo comes first"
    assert merged([e["choices"][0] for e in streamed]) == {k: whole[k] for k in ("text", "logprobs")}


def test_a_stop_token_has_its_log_probability(client: TestClient):
    choice = client.post("/v1/completions", json={"prompt": "ab", "logprobs": 1}).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "ba" and lp["tokens"] == ["b", "a", ""], "the stop token is not in the text"
    assert lp["token_logprobs"][-1] == fake_logprob(EOS, 1).logprob == lp["top_logprobs"][-1][""]
    assert lp["text_offset"] == [0, 1, 2]


@pytest.mark.parametrize("top", [None, 0, 3])
def test_chat_logprobs_whole_and_streamed(client: TestClient, top):
    body = {"messages": [{"role": "user", "content": "xy"}], "max_tokens": 3, "logprobs": True, "top_logprobs": top}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == whole["message"]["content"]
    for token in content:
        expected = fake_logprob(ord(token["token"]), top or 0)
        assert token["logprob"] == expected.logprob and token["bytes"] == list(token["token"].encode())
        assert [(t["token"], t["logprob"]) for t in token["top_logprobs"]] == [(chr(i), v) for i, v in expected.top]
    streamed = events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert streamed[0]["choices"][0]["logprobs"] is None, "the role chunk has no token"
    assert [t for e in streamed[1:] for t in e["choices"][0]["logprobs"]["content"]] == content
    plain = client.post("/v1/chat/completions", json={**body, "logprobs": None, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_token_texts_of_partial_characters_and_unbounded_logprobs():
    tokenizer = build_tiny_tokenizer()
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("é!", add_special_tokens=False)
    entries = [TokenLogprob(ids[0], -math.inf, ((ids[1], -0.5),)), TokenLogprob(ids[1], -0.5), TokenLogprob(ids[2], -1.0)]
    offsets = TextOffsets()
    offsets.begin_text(4)  # as after a 4-character echo: "abcdé!"
    legacy = completion_logprobs(texts, offsets, ids, entries, text_end=6)
    assert legacy.tokens == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    assert legacy.token_logprobs == [LOGPROB_FLOOR, -0.5, -1.0]
    assert legacy.top_logprobs[0] == {"bytes:\\xa9": -0.5, "bytes:\\xc3": LOGPROB_FLOOR}
    assert legacy.text_offset == [4, 4, 5] and offsets.chars == 6, "both pieces of é at its offset"
    chat = chat_logprobs(texts, entries).content
    assert [t.bytes for t in chat] == [[0xC3], [0xA9], [ord("!")]] and chat[0].top_logprobs[0].token == "bytes:\\xa9"
