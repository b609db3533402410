"""The text a client gets continues its prompt's, through the HTTP routes, the `Engine` and the
real `Request` detokenizer (a scripted scheduler releases a fixed output token by token): with a
Llama-style SentencePiece tokenizer the first output word keeps its space, whole and streamed,
with ``echo`` (and its ``logprobs`` tokens laid end to end are the text), with stop strings,
on /v1/completions and /generate."""
import json

import pytest
from fastapi.testclient import TestClient

from arfusion.engine.common.generation import TokenLogprob
from arfusion.engine.scheduling.request import Request
from arfusion.engine.server.api import build_app
from arfusion.engine.server.engine import Engine
from tests.llama_tokenizer import llama_style_tokenizer

pytestmark = pytest.mark.timeout(60)
TOKENIZER = llama_style_tokenizer()
PROMPT = "The capital of France is"
OUTPUT = " Paris Paris Paris"


class ScriptedScheduler:
    """Answers every request with the ids of ``OUTPUT`` and the end token, one release per token,
    as the scheduler does (log-probabilities 0.0 where asked for)."""

    alive = True
    failure = None

    def submit(self, req: Request) -> None:
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = [TokenLogprob(t, 0.0) for t in req.prompt_ids[1:]]
        for token in TOKENIZER.encode(OUTPUT, add_special_tokens=False) + [TOKENIZER.eos_token_ids[0]]:
            req.output_ids.append(token)
            if req.params.logprobs is not None:
                req.output_logprobs.append(TokenLogprob(token, 0.0))
            req.check_finished(TOKENIZER.eos_token_ids, 1000)
            req.emit(req.release(TOKENIZER))
            if req.finish_reason is not None:
                return
        raise AssertionError("the script ended before the request")

    def abort(self, rid: int) -> None:
        pass


@pytest.fixture(scope="module")
def client() -> TestClient:
    engine = Engine(ScriptedScheduler(), TOKENIZER, "m", 1000, lambda: None, info=dict)
    return TestClient(build_app(engine, "m"))


def post(client: TestClient, route: str, body: dict) -> tuple[str, list[dict]]:
    """The choice's text (streamed: the events' texts joined) and the choices."""
    resp = client.post(route, json=body)
    assert resp.status_code == 200, resp.text
    if not body.get("stream"):
        data = resp.json()
        choices = data.get("choices", [data])
    else:
        choices = [json.loads(e[len("data: "):]) for e in resp.text.split("\n\n") if e and e != "data: [DONE]"]
        choices = [c["choices"][0] if "choices" in c else c for c in choices if c.get("choices", [1])]
    texts = [c.get("text", c.get("message", c.get("delta", {})).get("content") or "") for c in choices]
    return ("".join(texts) if body.get("stream") and route != "/generate" else texts[-1]), choices


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop, expected", [([], OUTPUT), (["s P"], " Pari"), ([" Paris"], "")])
def test_completions_keep_the_first_space(client: TestClient, stream: bool, stop: list[str], expected: str):
    text, _ = post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stop": stop, "stream": stream})
    assert text == expected


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_lays_the_tokens_end_to_end(client: TestClient, stream: bool):
    body = {"prompt": PROMPT, "max_tokens": 8, "echo": True, "logprobs": 1, "stream": stream}
    text, choices = post(client, "/v1/completions", body)
    assert text == PROMPT + OUTPUT
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert "".join(tokens) == text
    assert [text[o:o + len(t)] for t, o in zip(tokens, offsets)] == tokens


@pytest.mark.parametrize("stream", [False, True])
def test_generate_keeps_the_first_space(client: TestClient, stream: bool):
    generate = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8}, "stream": stream}
    text, choices = post(client, "/generate", generate)
    assert text == OUTPUT, choices
