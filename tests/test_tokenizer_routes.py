"""The tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) in vLLM's shapes, with the
built-in tiny tokenizer and the fake engine's; `Tokenizer.token_bytes` for byte-level and
byte-fallback (SentencePiece-style) vocabularies."""
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from arfusion.engine.models.builtin import builtin_config
from arfusion.engine.server.api import build_app
from arfusion.engine.tokenizers.tokenizer import Tokenizer, build_tiny_tokenizer
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)
CTX = 64
MESSAGES = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def client_for(tokenizer=None) -> tuple[TestClient, FakeEngine]:
    fake = FakeEngine(context_length=CTX)
    if tokenizer is not None:
        fake.tokenizer = tokenizer
    return TestClient(build_app(fake, "served")), fake


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_a_prompt_then_detokenize_it(add_special_tokens: bool):
    tokenizer = build_tiny_tokenizer()
    client, _ = client_for(tokenizer)
    text = "Grüße, world"
    body = client.post("/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens}).json()
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert body == {"count": len(ids), "max_model_len": CTX, "tokens": ids}
    assert (ids[0] == tokenizer.bos_token_id) == add_special_tokens
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}


def test_tokenized_messages_are_what_the_chat_endpoint_sends():
    client, fake = client_for()
    body = client.post("/tokenize", json={"messages": MESSAGES, "model": "served"}).json()
    assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    assert body["tokens"] == fake.requests[-1][0] and body["count"] == len(body["tokens"])
    assert "<system>Be brief." in fake.tokenizer.decode(body["tokens"]), "developer is a system message"
    without = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert body["tokens"][:without["count"]] == without["tokens"] and without["count"] < body["count"]


def test_token_strs_are_the_tokens_texts():
    client, _ = client_for(build_tiny_tokenizer())
    body = client.post("/tokenize", json={"prompt": "a é", "return_token_strs": True}).json()
    assert body["token_strs"] == ["<|begin_of_text|>", "a", " ", "bytes:\\xc3", "bytes:\\xa9"]


@pytest.mark.parametrize("path, body, status, fragments", [
    ("/tokenize", {}, 400, ["messages", "prompt"]),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, ["`other`"]),
    ("/tokenize", {"messages": [{"role": "tool", "content": "1"}]}, 400, ["messages[0].role 'tool'"]),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, ["continue_final_message"]),
    ("/tokenize", {"messages": []}, 400, ["messages must not be empty"]),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, ["either prompt or messages, not both"]),
    ("/tokenize", {"messages": MESSAGES, "prompt": ""}, 400, ["either prompt or messages, not both"]),
    ("/detokenize", {"tokens": [5, 258, -1]}, 400, ["out of range [0, 258)", "258, -1"]),
    ("/detokenize", {"tokens": "abc"}, 400, ["tokens"]),
])
def test_bad_tokenizer_requests_name_the_problem(path: str, body: dict, status: int, fragments: list[str]):
    client, _ = client_for()
    resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    for fragment in fragments:
        assert fragment in resp.json()["error"]["message"]


def test_tokenizer_info_names_the_special_tokens():
    tokenizer = build_tiny_tokenizer()
    info = client_for(tokenizer)[0].get("/tokenizer_info").json()
    assert info["bos_token"] == "<|begin_of_text|>" and info["eos_token"] == "<|end_of_text|>"
    assert info["add_bos_token"] is True and info["eos_token_ids"] == list(tokenizer.eos_token_ids)
    assert info["vocab_size"] == tokenizer.vocab_size and info["model_max_length"] == CTX
    assert info["chat_template"] == tokenizer.chat_template
    tokenizer.tokenizer.post_processor = None  # a tokenizer that adds no start token to text
    assert client_for(tokenizer)[0].get("/tokenizer_info").json()["add_bos_token"] is False


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_the_tiny_models_config_has_the_tiny_tokenizers_ids(model: str):
    config, tokenizer = builtin_config(model), build_tiny_tokenizer()
    assert config.vocab_size == tokenizer.vocab_size
    assert (config.bos_token_id, config.eos_token_ids) == (tokenizer.bos_token_id, tokenizer.eos_token_ids)


def test_token_bytes_of_byte_level_and_byte_fallback_vocabularies():
    tiny = build_tiny_tokenizer()
    assert [tiny.token_bytes(i) for i in tiny.encode("é\n", add_special_tokens=False)] == [b"\xc3", b"\xa9", b"\n"]
    assert tiny.token_bytes(tiny.bos_token_id) == b"<|begin_of_text|>"
    vocab = {"<unk>": 0, "\u2581the": 1, "<0x0A>": 2, "<0xE2>": 3, "x": 4}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp = Tokenizer(hf, None, [], None)
    assert [sp.token_bytes(i) for i in range(1, 5)] == [b" the", b"\n", b"\xe2", b"x"]
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        sp.token_bytes(99)
