"""The HTTP layer's errors against the `FakeEngine`: OpenAI's error object everywhere (unknown
paths, wrong methods, bodies that are not UTF-8 JSON, internal faults), integers bounded to
int64, floats finite and strings valid Unicode at the API, `EngineError` statuses, and the
503 of a draining server. After every error the server still answers a good request."""
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from arfusion.engine.common.generation import EngineError
from arfusion.engine.common.sampling_params import MAX_STOP_TOKEN_IDS
from arfusion.engine.server.api import build_app
from arfusion.engine.server.http.lifecycle import Lifecycle
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)
COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
INT64_MAX = 2**63 - 1


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine(context_length=64)


@pytest.fixture
def lifecycle() -> Lifecycle:
    return Lifecycle()


@pytest.fixture
def client(fake: FakeEngine, lifecycle: Lifecycle) -> TestClient:
    return TestClient(build_app(fake, "served", lifecycle), raise_server_exceptions=False)


def assert_error(resp: Any, status: int, *fragments: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == status, body
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]
    for fragment in fragments:
        assert fragment in body["error"]["message"], body


def assert_still_serving(client: TestClient) -> None:
    resp = client.post(COMPLETIONS, json={"prompt": "hello"})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "olleh", resp.text


@pytest.mark.parametrize("method, path, status, fragment", [
    ("GET", "/no/such/path", 404, "no such endpoint: GET /no/such/path"),
    ("POST", "/v2/completions", 404, "no such endpoint"),
    ("GET", COMPLETIONS, 405, "method GET is not allowed on /v1/completions"),
    ("DELETE", "/health", 405, "method DELETE"),
])
def test_unknown_paths_and_methods(client: TestClient, method: str, path: str, status: int, fragment: str) -> None:
    assert_error(client.request(method, path), status, fragment)
    assert_still_serving(client)


@pytest.mark.parametrize("raw, fragment", [
    (b'{"prompt": "\xff\xfe"}', "not valid JSON: 'utf-8' codec can't decode"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"prompt": "a", "max_tokens": 1e}', "malformed JSON"),
])
def test_bodies_that_are_not_utf8_json(client: TestClient, fake: FakeEngine, raw: bytes, fragment: str) -> None:
    assert_error(client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"}), 400, fragment)
    assert fake.requests == []
    assert_still_serving(client)


OUT_OF_RANGE = [  # (url, raw JSON body, fields named in the message)
    (COMPLETIONS, '{"prompt": "hi", "top_k": 9223372036854775808, "temperature": 1}', ["top_k"]),
    (COMPLETIONS, '{"prompt": "hi", "seed": 18446744073709551616, "temperature": 1}', ["seed"]),
    (COMPLETIONS, '{"prompt": "hi", "seed": -9223372036854775809}', ["seed"]),
    (COMPLETIONS, '{"prompt": "hi", "max_tokens": 100000000000000000000000}', ["max_tokens"]),
    (COMPLETIONS, '{"prompt": "hi", "stop_token_ids": [1, 9223372036854775808]}', ["stop_token_ids"]),
    (COMPLETIONS, '{"prompt": [1, 9223372036854775808]}', ["prompt"]),
    (COMPLETIONS, '{"prompt": "hi", "n": 1e400}', ["n"]),
    (COMPLETIONS, '{"prompt": "hi", "temperature": NaN}', ["temperature", "finite"]),
    (COMPLETIONS, '{"prompt": "hi", "temperature": Infinity}', ["temperature", "finite"]),
    (COMPLETIONS, '{"prompt": "hi", "temperature": 1e400}', ["temperature", "finite"]),
    (COMPLETIONS, '{"prompt": "hi", "top_p": -Infinity}', ["top_p", "finite"]),
    (COMPLETIONS, '{"prompt": "hi", "presence_penalty": NaN}', ["presence_penalty"]),
    (COMPLETIONS, '{"prompt": "\\ud800"}', ["prompt", "not valid Unicode"]),
    (COMPLETIONS, '{"prompt": "hi", "stop": ["\\udfff"]}', ["stop", "not valid Unicode"]),
    (COMPLETIONS, '{"prompt": "hi", "model": "\\ud800"}', ["model"]),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud83d"}]}', ["content", "not valid Unicode"]),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9223372036854775808}',
     ["max_completion_tokens"]),
    (GENERATE, '{"text": "hi", "sampling_params": {"top_k": 9223372036854775808}}', ["top_k"]),
    (GENERATE, '{"text": "hi", "sampling_params": {"temperature": NaN}}', ["temperature"]),
    (GENERATE, '{"input_ids": [9223372036854775808]}', ["input_ids"]),
]


@pytest.mark.parametrize("url, raw, fields", OUT_OF_RANGE)
def test_values_the_engine_cannot_hold_are_400(client: TestClient, fake: FakeEngine, url: str, raw: str,
                                                fields: list[str]) -> None:
    assert_error(client.post(url, content=raw.encode(), headers={"content-type": "application/json"}), 400, *fields)
    assert fake.requests == [], "the engine never sees the value"
    assert_still_serving(client)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("url, body, fragment", [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [-1, 10**12]},
     "stop_token_ids: token ids out of range [0, 258): [-1, 1000000000000]"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [97, 258]}, "stop_token_ids: token ids out of range [0, 258): [258]"),
    (CHAT, {"messages": HI, "stop_token_ids": [-5]}, "stop_token_ids: token ids out of range [0, 258): [-5]"),
    (GENERATE, {"text": "hi", "sampling_params": {"stop_token_ids": [300]}}, "stop_token_ids: token ids out of range"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [97] * (MAX_STOP_TOKEN_IDS + 1)},
     f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {MAX_STOP_TOKEN_IDS + 1}"),
])
def test_stop_token_ids_are_checked_like_logit_bias_ids(client: TestClient, fake: FakeEngine, url: str, body: dict,
                                                         fragment: str) -> None:
    assert_error(client.post(url, json=body), 400, fragment)
    assert fake.requests == [], "the engine never sees them"
    body = {"prompt": "hello", "stop_token_ids": [ord("l")] * (MAX_STOP_TOKEN_IDS - 2) + [0, 257]}
    assert client.post(COMPLETIONS, json=body).json()["choices"][0]["text"] == "o", "the most ids, at the range's ends"


@pytest.mark.parametrize("url, body", [(COMPLETIONS, {"prompt": "hi", "n": 2}), (CHAT, {"messages": HI, "n": 2})])
def test_n_is_named_once(client: TestClient, url: str, body: dict) -> None:
    resp = client.post(url, json=body)
    assert_error(resp, 400, "n (only n=1 is supported)")
    assert resp.json()["error"]["message"].count("n (") == 1, resp.json()


def test_int64_limits_themselves_are_accepted(client: TestClient, fake: FakeEngine) -> None:
    body = {"prompt": "hi", "top_k": INT64_MAX, "seed": -(2**63), "temperature": 1e-30, "max_tokens": 2}
    assert client.post(COMPLETIONS, json=body).status_code == 200
    params = fake.requests[-1][1]
    assert (params.top_k, params.seed, params.greedy) == (INT64_MAX, -(2**63), True)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error", [EngineError(400, "cannot fit"), EngineError(503, "shutting down"),
                                   EngineError(500, "worker died")])
def test_engine_errors_keep_their_status(client: TestClient, fake: FakeEngine, error: EngineError,
                                         stream: bool) -> None:
    fake.fail_after, fake.failure = 0, error
    assert_error(client.post(COMPLETIONS, json={"prompt": "abc", "stream": stream}), error.status, error.message)
    fake.fail_after = 2
    resp = client.post(COMPLETIONS, json={"prompt": "abcdef", "stream": stream})
    if stream:  # the status line is sent: an error event, then [DONE]
        events = [block[len("data: "):] for block in resp.text.split("\n\n") if block]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"] == {"message": error.message, "type": error_type(error.status),
                                                   "code": error.status}
    else:
        assert_error(resp, error.status, error.message)
    fake.fail_after = None
    assert_still_serving(client)


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}[status]


def test_a_fault_while_preparing_one_request_is_a_json_500(client: TestClient, fake: FakeEngine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    encode = fake.tokenizer.encode
    monkeypatch.setattr(fake.tokenizer, "encode",
                        lambda text, **kw: 1 // 0 if text == "boom" else encode(text, **kw))
    assert_error(client.post(COMPLETIONS, json={"prompt": "boom"}), 500, "ZeroDivisionError")
    assert_still_serving(client)


def test_a_draining_server_refuses_new_requests_with_503(client: TestClient, lifecycle: Lifecycle) -> None:
    lifecycle.draining = True
    for url, body in [(COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
                      (GENERATE, {"text": "hi"})]:
        assert_error(client.post(url, json=body), 503, "shutting down")
    assert client.get("/health").status_code == 503
    assert client.get("/v1/models").status_code == 200, "read-only endpoints still answer"
    lifecycle.draining = False
    assert_still_serving(client)
    assert lifecycle.in_flight == 0
