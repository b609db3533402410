"""A gpt-oss-style tokenizer directory: the chat template in ``chat_template.jinja`` beside a
``tokenizer_config.json`` without one (as the gpt-oss checkpoints ship it), in the harmony
format, calling HF's ``strftime_now`` global; `load_tokenizer` takes it and ``/tokenize`` with
``messages`` renders it. The template here is a small one of ours in harmony's shape, not the
checkpoint's."""
import datetime
import json

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from arfusion.engine.server.api import build_app
from arfusion.engine.tokenizers.tokenizer import gpt2_bytes_to_unicode, load_tokenizer
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)
HARMONY_TOKENS = ["<|startoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>"]
TEMPLATE = (
    "<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture
def tokenizer_dir(tmp_path):
    vocab = {ch: byte for byte, ch in gpt2_bytes_to_unicode().items()}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(HARMONY_TOKENS)
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|startoftext|>", "eos_token": "<|return|>"}))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    return tmp_path


def test_template_file_is_used_and_tokenize_renders_it(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    text = tokenizer.apply_chat_template(MESSAGES)
    today = datetime.date.today().isoformat()
    assert text == (f"<|start|>system<|message|>Current date: {today}<|end|><|start|>user<|message|>Hi there<|end|>"
                    "<|start|>assistant")
    fake = FakeEngine(context_length=256)
    fake.tokenizer = tokenizer
    client = TestClient(build_app(fake, "gpt-oss"))
    body = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["tokens"][:1] == [tokenizer.tokenizer.token_to_id("<|start|>")], "special tokens stay one id each"
