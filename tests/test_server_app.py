"""The HTTP layer (engine/server) against the scripted `FakeEngine` (tests/fake_engine.py).

The fake replies with the prompt's text reversed, then EOS; prompts encode as BOS + one id per
character, so "hello" is 6 prompt tokens and its reply "olleh" 6 completion tokens (EOS counted).
"""
import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.server.api import build_app
from tests.fake_engine import BOS, FakeEngine

SERVED = "served-model"
CTX = 64
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine(context_length=CTX)


@pytest.fixture
def client(fake: FakeEngine) -> TestClient:
    return TestClient(build_app(fake, SERVED))


def events_of(text: str) -> list[Any]:
    """The SSE payloads of a stream: parsed JSON, and "[DONE]" as a string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_good_completion(client: TestClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hello"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "olleh"


def test_completion_non_streaming(client: TestClient, fake: FakeEngine) -> None:
    resp = client.post("/v1/completions", json={"model": SERVED, "prompt": "hello"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == SERVED
    assert body["choices"] == [{"index": 0, "text": "olleh", "finish_reason": "stop", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert fake.requests == [([BOS, *b"hello"], SamplingParams(max_tokens=16))]


def test_sampling_fields_reach_the_engine(client: TestClient, fake: FakeEngine) -> None:
    fields = {"max_tokens": 5, "temperature": 0.0, "top_p": 0.5, "top_k": 7, "seed": 11, "stop": ["zz", "y"],
              "stop_token_ids": [3, 4], "ignore_eos": True}
    assert client.post("/v1/completions", json={"prompt": "hi", **fields}).status_code == 200
    expected = SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, top_k=7, seed=11, stop=("zz", "y"),
                              stop_token_ids=(3, 4), ignore_eos=True)
    assert fake.requests[-1][1] == expected


@pytest.mark.parametrize("extra, text, finish, completion_tokens", [
    ({"max_tokens": 3}, "fed", "length", 3),
    ({"stop": "dc"}, "fe", "stop", 4),
    ({"stop": ["c", "e"]}, "f", "stop", 2),
    ({"stop": ["zz"]}, "fedcba", "stop", 7),
    ({"stop_token_ids": [ord("d")]}, "fe", "stop", 3),
    ({"ignore_eos": True, "max_tokens": 8}, "fedcbafe", "length", 8),
])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_endings(client: TestClient, extra: dict, text: str, finish: str, completion_tokens: int,
                            stream: bool) -> None:
    body = {"prompt": "abcdef", "stream": stream, "stream_options": {"include_usage": True}, **extra}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    usage = {"prompt_tokens": 7, "completion_tokens": completion_tokens, "total_tokens": 7 + completion_tokens}
    if not stream:
        assert resp.json()["choices"][0]["text"] == text and resp.json()["choices"][0]["finish_reason"] == finish
        assert resp.json()["usage"] == usage
        return
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = events_of(resp.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == usage
    choices = [e["choices"][0] for e in events[:-2]]
    assert all(e["object"] == "text_completion" and e["model"] == SERVED for e in events[:-1])
    assert len({e["id"] for e in events[:-1]}) == 1
    assert "".join(c["text"] for c in choices) == text
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [finish]


def test_stream_without_usage_ends_with_finish_then_done(client: TestClient) -> None:
    events = events_of(client.post("/v1/completions", json={"prompt": "abc", "stream": True}).text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(e["usage"] is None and len(e["choices"]) == 1 for e in events[:-1])
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["c", "b", "a", ""]


@pytest.mark.parametrize("prompt, prompt_ids, text", [
    ([104, 105, 106], [104, 105, 106], "jih"),
    (["ab"], [BOS, 97, 98], "ba"),
    ([[BOS, 120, 121]], [BOS, 120, 121], "yx"),
])
def test_completion_prompt_forms(client: TestClient, fake: FakeEngine, prompt: Any, prompt_ids: list[int],
                                 text: str) -> None:
    resp = client.post("/v1/completions", json={"prompt": prompt})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == text
    assert resp.json()["usage"]["prompt_tokens"] == len(prompt_ids) and fake.requests[-1][0] == prompt_ids


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
CHAT_PROMPT = "<system>Be brief.\n<user>hi\n<assistant>"


def test_chat_non_streaming(client: TestClient, fake: FakeEngine) -> None:
    resp = client.post("/v1/chat/completions", json={"model": SERVED, "messages": CHAT, "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == SERVED
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": ">tna"},
                                "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": len(CHAT_PROMPT), "completion_tokens": 4,
                             "total_tokens": len(CHAT_PROMPT) + 4}
    assert fake.requests[-1][0] == list(CHAT_PROMPT.encode()), "the template's text, no BOS added"


def test_chat_defaults_to_the_rest_of_the_context(client: TestClient, fake: FakeEngine) -> None:
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}]})
    prompt = "<user>ab\n<assistant>"
    assert resp.json()["choices"][0]["message"]["content"] == prompt[::-1]
    assert fake.requests[-1][1].max_tokens == CTX - len(prompt)
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 3})
    assert fake.requests[-1][1].max_tokens == 3


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_streaming(client: TestClient, include_usage: bool) -> None:
    body = {"messages": CHAT, "stream": True, "max_tokens": 5, "stream_options": {"include_usage": include_usage}}
    events = events_of(client.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]"
    events = events[:-1]
    if include_usage:
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
        events = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant"}
    assert "".join(d["content"] for d in deltas[1:]) == ">tnat"
    finishes = [e["choices"][0]["finish_reason"] for e in events]
    assert finishes == [None] * (len(events) - 1) + ["length"]


def test_chat_template_error_is_400(client: TestClient, fake: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_template(messages: list, add_generation_prompt: bool = True) -> str:
        raise ValueError("this tokenizer has no chat template")

    monkeypatch.setattr(fake.tokenizer, "apply_chat_template", no_template)
    resp = client.post("/v1/chat/completions", json={"messages": CHAT})
    assert resp.status_code == 400 and "no chat template" in resp.json()["error"]["message"]
    assert_good_completion(client)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", [{"text": "abc"}, {"input_ids": [BOS, 97, 98, 99]}])
def test_generate(client: TestClient, fake: FakeEngine, prompt: dict, stream: bool) -> None:
    body = {**prompt, "stream": stream, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    expected = {"text": "cb", "output_ids": [99, 98],
                "meta_info": {"prompt_tokens": 4, "completion_tokens": 2, "finish_reason": "length"}}
    if stream:
        events = events_of(resp.text)
        assert events[-1] == "[DONE]" and events[-2] == expected
        assert [e["text"] for e in events[:-1]] == ["c", "cb"], "cumulative text"
    else:
        assert resp.json() == expected
    assert fake.requests[-1] == ([BOS, 97, 98, 99], SamplingParams(max_tokens=2, temperature=0.0))


def test_generate_honours_sglang_sampling_fields(client: TestClient, fake: FakeEngine) -> None:
    fields = {"max_new_tokens": 3, "min_new_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
              "repetition_penalty": 1.25, "logit_bias": {"98": 200.0}}
    resp = client.post("/generate", json={"text": "abc", "sampling_params": fields})
    assert resp.status_code == 200, resp.text
    assert fake.requests[-1][1] == SamplingParams(max_tokens=3, min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.5,
                                                  repetition_penalty=1.25, logit_bias=((98, 100.0),))


def test_models_health_info(client: TestClient, fake: FakeEngine) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED] and models["data"][0]["max_model_len"] == CTX
    assert client.get("/get_server_info").json() == fake.server_info()
    assert client.get("/health").status_code == 200 and client.get("/health").json() == {"status": "ok"}
    fake.healthy = False
    assert client.get("/health").status_code == 503
    resp = client.post("/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 503 and "not healthy" in resp.json()["error"]["message"]
    fake.healthy = True
    assert_good_completion(client)


def async_client(fake: FakeEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(fake, SERVED)), base_url="http://test")


def test_flush_cache_refused_while_running(fake: FakeEngine) -> None:
    async def scenario() -> None:
        async with async_client(fake) as http:
            assert (await http.post("/flush_cache")).status_code == 200 and fake.flushes == 1
            running = fake.generate([BOS, 97, 98], SamplingParams())
            await running.__anext__()
            busy = await http.post("/flush_cache")
            assert busy.status_code == 400 and "running" in busy.json()["error"]["message"]
            await running.aclose()
            assert (await http.post("/flush_cache")).status_code == 200 and fake.flushes == 2

    asyncio.run(scenario())


COMPLETIONS, CHAT_URL = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [  # (url, json body or raw bytes, status, message fragments)
    (COMPLETIONS, b'{"prompt": "hi",', 400, ["malformed JSON"]),
    (COMPLETIONS, b'["hi"]', 400, ["must be a JSON object"]),
    (COMPLETIONS, {"max_tokens": 4}, 400, ["prompt", "Field required"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, ["max_tokens"]),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, ["temperature"]),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400, ["stream"]),
    (COMPLETIONS, {"prompt": "abc", "max_tokens": 61}, 400, ["prompt_tokens (4)", "max_tokens (61)", "64"]),
    (COMPLETIONS, {"prompt": "a" * 63}, 400, ["64 tokens", "context length is 64"]),
    (COMPLETIONS, {"prompt": "hi", "model": "nope"}, 404, ["`nope`", f"`{SERVED}`"]),
    (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, 400, ["temperature must be >= 0"]),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0.0}, 400, ["top_p must be in (0, 1]"]),
    (COMPLETIONS, {"prompt": "hi", "top_k": 0}, 400, ["top_k must be -1"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens must be >= 1 (0 only with echo)"]),
    (CHAT_URL, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, ["max_tokens must be >= 1"]),
    (COMPLETIONS, {"prompt": "hi", "stop": ["x", ""]}, 400, ["stop strings must not be empty"]),
    (COMPLETIONS, {"prompt": ""}, 400, ["empty"]),
    (COMPLETIONS, {"prompt": []}, 400, ["empty"]),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, ["batch prompts are not supported"]),
    (COMPLETIONS, {"prompt": [5, 999]}, 400, ["out of range", "999"]),
    (COMPLETIONS, {"prompt": "hi", "n": 2}, 400, ["n (only n=1"]),
    (CHAT_URL, {"messages": []}, 400, ["messages must not be empty"]),
    (CHAT_URL, {"model": "gpt-4"}, 400, ["messages", "Field required"]),
    (CHAT_URL, {"messages": [{"role": "robot", "content": "hi"}]}, 400, ["role"]),
    (CHAT_URL, {"messages": [{"role": "user", "content": "x" * 60}]}, 400, ["context length is 64"]),
    (CHAT_URL, {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, ["`nope`"]),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, ["exactly one of text and input_ids"]),
    ("/generate", {"text": "ab", "input_ids": [1]}, 400, ["exactly one of text and input_ids"]),
    ("/generate", {"text": "ab", "sampling_params": {"top_p": 2.0}}, 400, ["top_p"]),
    ("/generate", {"text": "ab", "sampling_params": {"min_p": 0.1, "max_new_tokens": 2, "regex": "a+"}}, 400,
     ["not supported: sampling_params.min_p (unknown), sampling_params.regex (unknown)"]),
    ("/generate", {"text": "ab", "sampling_params": {"logit_bias": {"999": 1.0}}}, 400, ["logit_bias"]),
]


@pytest.mark.parametrize("url, body, status, fragments", BAD_REQUESTS)
def test_bad_request_then_good_one(client: TestClient, fake: FakeEngine, url: str, body: Any, status: int,
                                   fragments: list[str]) -> None:
    if isinstance(body, bytes):
        resp = client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        resp = client.post(url, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and isinstance(error["type"], str)
    for fragment in fragments:
        assert fragment in error["message"]
    assert fake.requests == [], "a rejected request never reaches the engine"
    assert_good_completion(client)


@pytest.mark.parametrize("url, body", [
    (COMPLETIONS, {"prompt": "abc"}),
    (CHAT_URL, {"messages": [{"role": "user", "content": "abc"}]}),
    ("/generate", {"text": "abc"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_before_output_is_500(client: TestClient, fake: FakeEngine, url: str, body: dict,
                                             stream: bool) -> None:
    fake.fail_after = 0
    resp = client.post(url, json={**body, "stream": stream})
    assert resp.status_code == 500 and "fake engine failure" in resp.json()["error"]["message"]
    fake.fail_after = None
    assert_good_completion(client)
    assert fake.aborted == [0] and fake.running == 0


@pytest.mark.parametrize("url, body", [(COMPLETIONS, {"prompt": "abcdef"}), (CHAT_URL, {"messages": CHAT})])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_mid_request(client: TestClient, fake: FakeEngine, url: str, body: dict,
                                    stream: bool) -> None:
    fake.fail_after = 2
    resp = client.post(url, json={**body, "stream": stream})
    if stream:  # the status is already sent: an error event, then [DONE]
        assert resp.status_code == 200
        events = events_of(resp.text)
        assert events[-1] == "[DONE]" and "fake engine failure" in events[-2]["error"]["message"]
        assert events[-2]["error"]["code"] == 500
    else:
        assert resp.status_code == 500 and "fake engine failure" in resp.json()["error"]["message"]
    fake.fail_after = None
    assert_good_completion(client)
    assert fake.aborted == [0] and fake.running == 0


def test_eight_concurrent_clients() -> None:
    fake = FakeEngine(context_length=CTX, token_delay_s=0.001)

    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, int]:
        prompt = f"client {i}: " + "xyz"[: i % 3 + 1]
        body = {"prompt": prompt, "stream": i % 2 == 1, "stream_options": {"include_usage": True}}
        resp = await http.post(COMPLETIONS, json=body)
        assert resp.status_code == 200, resp.text
        if i % 2 == 0:
            return resp.json()["choices"][0]["text"], resp.json()["usage"]["completion_tokens"]
        events = events_of(resp.text)
        return "".join(e["choices"][0]["text"] for e in events[:-2]), events[-2]["usage"]["completion_tokens"]

    async def scenario() -> list[tuple[str, int]]:
        async with async_client(fake) as http:
            return await asyncio.gather(*(one(http, i) for i in range(8)))

    results = asyncio.run(scenario())
    for i, (text, completion_tokens) in enumerate(results):
        prompt = f"client {i}: " + "xyz"[: i % 3 + 1]
        assert (text, completion_tokens) == (prompt[::-1], len(prompt) + 1), f"client {i} got another's reply"
    assert fake.max_running > 1, "requests overlapped in the engine"
    assert fake.running == 0 and fake.aborted == []


async def _stream_then_disconnect(fake: FakeEngine, path: str, body: dict, spec_version: str,
                                  events_read: int) -> tuple[list[bytes], list[int]]:
    """Drive the ASGI app directly: read ``events_read`` streamed events (0 or 1), then disconnect
    (ASGI < 2.4: an ``http.disconnect`` message; >= 2.4: ``send`` raises OSError). Returns the
    bodies sent and ``fake.aborted`` the moment the app returns (not later, when GC would close)."""
    app = build_app(fake, SERVED)
    sent: list[bytes] = []
    first_event = asyncio.Event()
    requested = False

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if events_read:
            await first_event.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if spec_version == "2.4" and len(sent) == events_read:
            raise OSError("client went away")
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            first_event.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("test", 1),
             "server": ("test", 80)}
    with contextlib.suppress(ClientDisconnect, OSError):  # OSError: a 2.4 send after the disconnect (the 499)
        await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent, list(fake.aborted)


DISCONNECTING = [
    (COMPLETIONS, {"prompt": "abc"}),
    (CHAT_URL, {"messages": [{"role": "user", "content": "abc"}]}),
    ("/generate", {"text": "abc"}),
]


def _long_request(path: str, body: dict, stream: bool) -> dict:
    if path == "/generate":
        return {"text": "abc", "stream": stream, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    return {**body, "stream": stream, "max_tokens": 40, "ignore_eos": True}


@pytest.mark.parametrize("spec_version, events_read", [("2.0", 1), ("2.4", 1), ("2.4", 0)])
@pytest.mark.parametrize("path, body", DISCONNECTING)
def test_client_disconnect_aborts_the_request(path: str, body: dict, spec_version: str, events_read: int) -> None:
    fake = FakeEngine(context_length=CTX, token_delay_s=0.005)
    body = _long_request(path, body, stream=True)
    sent, aborted_on_return = asyncio.run(_stream_then_disconnect(fake, path, body, spec_version, events_read))
    assert len(sent) == events_read if spec_version == "2.4" else 1 <= len(sent) < 40
    assert b"[DONE]" not in b"".join(sent)
    assert aborted_on_return == [0] and fake.running == 0


@pytest.mark.parametrize("path, body", DISCONNECTING)
def test_client_disconnect_aborts_a_non_streaming_request(path: str, body: dict) -> None:
    """The client leaves while its request runs (40 tokens, 5 ms each): the request is aborted
    at once, not run to its end for no one."""
    fake = FakeEngine(context_length=CTX, token_delay_s=0.005)
    sent, aborted_on_return = asyncio.run(_stream_then_disconnect(fake, path, _long_request(path, body, False),
                                                                  "2.0", events_read=0))
    assert sent == [] and aborted_on_return == [0] and fake.running == 0
