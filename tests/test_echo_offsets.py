"""``echo`` with ``logprobs``: ``text_offset`` indexes into the returned ``text`` for every
tokenizer (the tiny byte-level one, a SentencePiece GGUF vocab, a Qwen2-style byte-level GGUF
vocab with control tokens): the tokens laid end to end at their offsets are the text; a BOS (or
any token not in the text) has the empty text at offset where the next text begins, as vLLM
shows it. The HTTP layer against the `FakeEngine` with the real tokenizer, whole and streamed."""
import json
import re

import pytest
from fastapi.testclient import TestClient

from arfusion.engine.server.api import build_app
from arfusion.engine.tokenizers.serving import load_serving_tokenizer
from arfusion.engine.tokenizers.tokenizer import Tokenizer, build_tiny_tokenizer
from tests.fake_engine import FakeEngine
from tests.gguf_files import qwen2_chat_file, write_spm_file

pytestmark = pytest.mark.timeout(120)
PROMPTS = ["Hi", "hello world", " hello", "hello  world", "héllo wörld é!", "xyz hello", "a\nb"]
SPECIALS_IN_TEXT = {"tiny": "hi<|im_start|>there", "spm": "<s>hello", "qwen2": "hello<|im_start|>world"}


@pytest.fixture(scope="module", params=["tiny", "spm", "qwen2"])
def named_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Tokenizer]:
    if request.param == "tiny":
        return "tiny", build_tiny_tokenizer()
    directory = tmp_path_factory.mktemp(request.param)
    path = write_spm_file(directory / "spm.gguf", xy_first=True)[0] if request.param == "spm" \
        else qwen2_chat_file(directory / "qwen2.gguf")[0]
    return request.param, load_serving_tokenizer(str(path))


def client_with(tokenizer: Tokenizer) -> TestClient:
    fake = FakeEngine(context_length=256)
    fake.tokenizer = tokenizer
    return TestClient(build_app(fake, "served"))


def piece_bytes(token: str) -> bytes:
    """A token's text as bytes, OpenAI's ``bytes:\\xNN`` pieces as those bytes."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
    return token.encode()


def laid_end_to_end(tokens: list[str]) -> str:
    return b"".join(piece_bytes(t) for t in tokens).decode()


def echo(client: TestClient, prompt, stream: bool = False) -> tuple[str, dict]:
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "stream": stream}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        return choice["text"], choice["logprobs"]
    events = [json.loads(b[len("data: "):])["choices"][0] for b in resp.text.split("\n\n")[:-2]]
    parts = [e["logprobs"] for e in events if e["logprobs"]]
    return "".join(e["text"] for e in events), {k: [v for p in parts for v in p[k]] for k in parts[0]}


def assert_offsets_index_the_text(text: str, lp: dict, ids: list[int]) -> None:
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert len(tokens) == len(offsets) == len(ids)
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), offsets
    assert laid_end_to_end(tokens) == text, tokens
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token, (token, offset, text)
        else:  # a piece of a character: at that character's offset
            assert piece_bytes(token) in text[offset].encode(), (token, offset, text)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "ids"])
def test_echo_offsets_index_the_returned_text(named_tokenizer, prompt: str, as_ids: bool):
    name, tokenizer = named_tokenizer
    client, ids = client_with(tokenizer), tokenizer.encode(prompt)
    text, lp = echo(client, ids if as_ids else prompt)
    assert text == (tokenizer.decode(ids) if as_ids else prompt)
    assert_offsets_index_the_text(text, lp, ids)
    if tokenizer.adds_bos:
        assert (lp["tokens"][0], lp["text_offset"][0], lp["token_logprobs"][0]) == ("", 0, None), "BOS: not in the text"
    assert echo(client, ids if as_ids else prompt, stream=True) == (text, lp), "streamed as whole"


def test_special_tokens_written_in_the_prompt_stand_where_they_are(named_tokenizer):
    """A special token's text typed in a text prompt is in the echoed text (the string as sent):
    there it has its text and offset; decoded from ids, it is left out (empty text)."""
    name, tokenizer = named_tokenizer
    prompt = SPECIALS_IN_TEXT[name]
    client, ids = client_with(tokenizer), tokenizer.encode(prompt)
    for sent in (prompt, ids):
        text, lp = echo(client, sent)
        assert_offsets_index_the_text(text, lp, ids)


def test_a_bos_has_empty_text_at_offset_0_with_the_tiny_tokenizer():
    text, lp = echo(client_with(build_tiny_tokenizer()), "Hi")
    assert text == "Hi" and lp["tokens"] == ["", "H", "i"] and lp["text_offset"] == [0, 0, 1]


def test_output_offsets_continue_after_the_echo():
    """Echo, then output (the fake reverses the prompt, then EOS, which is not in the text)."""
    client = client_with(build_tiny_tokenizer())
    body = {"prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 5}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "abccba"
    assert lp["tokens"] == ["", "a", "b", "c", "c", "b", "a", ""]
    assert lp["text_offset"] == [0, 0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("ids", [[0xFF, 65], [0xC3, 65, 0xA9], [0xE2, 0x82, 66, 0x80]], ids=str)
def test_ids_that_are_no_utf8_stand_as_the_replacement_character(ids: list[int]):
    """Byte tokens that decode to U+FFFD in the echoed text stand there as it."""
    tokenizer = build_tiny_tokenizer()
    ids = [tokenizer.bos_token_id, *ids]
    text, lp = echo(client_with(tokenizer), ids)
    assert "\ufffd" in text
    assert_offsets_index_the_text(text, lp, ids)
