"""Tokenizers: the built-in tiny one (made by code, no download) and HF tokenizer files.

`Tokenizer` wraps a ``tokenizers.Tokenizer`` with what the engine needs: encode/decode, the
BOS/EOS ids, and a jinja chat template rendered the way HF's ``apply_chat_template`` renders it
(variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``).

The tiny tokenizer is byte-level: ids 0..255 are the 256 bytes (GPT-2's byte-to-unicode
alphabet, no merges), followed by 8 special tokens: 264 ids in all (divisible by 1, 2, 4, 8
for a vocabulary-parallel embedding).
"""
from __future__ import annotations

import datetime
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

TINY_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
)
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a template beside tokenizer_config.json (transformers >= 4.43 writes it so)
SPIECE_SPACE = "\u2581"  # SentencePiece's word-start mark
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus special-token ids and a chat template."""

    def __init__(self, tokenizer: HFTokenizer, bos_token: Optional[str], eos_tokens: Sequence[str],
                 chat_template: Optional[str]) -> None:
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = self._token_id(bos_token) if bos_token is not None else None
        self.eos_token_ids = tuple(self._token_id(t) for t in eos_tokens)
        self.chat_template = chat_template
        byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._byte_of = {ch: b for b, ch in gpt2_bytes_to_unicode().items()} if byte_level else None
        self._template: Optional[jinja2.Template] = None
        if chat_template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the tokenizer's post-processor
        (e.g. a leading BOS). Text rendered by `apply_chat_template` already has its special
        tokens: encode it with ``add_special_tokens=False``. Runs as a batch of one without
        offsets: the call that releases the GIL while it encodes, and whose result takes little
        time to free (``encode`` holds the GIL, seconds for a megabyte-long text, during which no
        other thread of the process runs; freeing its result holds it for tens of milliseconds)."""
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        """The special (control) tokens' texts and ids: the added tokens marked special."""
        return {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    @cached_property
    def _text_only(self) -> HFTokenizer:
        """A copy of the tokenizer that splits special tokens' texts like any other text (made at
        first use, after any tokens were added; a copy, so that no shared flag flips between threads).
        It shares the tokenizer's model, whose settings (its word cache's capacity) JSON does not keep."""
        copy = HFTokenizer.from_str(self.tokenizer.to_str())
        copy.model = self.tokenizer.model
        copy.encode_special_tokens = True
        return copy

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special token: a special token's text in it (say
        ``<|im_end|>``) is tokenized as the characters it is made of; nothing is added."""
        return self._text_only.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, possibly): a byte-level
        vocabulary's piece mapped back through GPT-2's alphabet, a byte-fallback piece ``<0xNN>``
        that byte, any other its decoded text (a leading SentencePiece "▁" as a space). A special
        token stands for its text. ValueError for an id outside the vocabulary."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the tokenizer's vocabulary")
        if self._byte_of is not None and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        text = self.decode([token_id], skip_special_tokens=False)
        if piece.startswith(SPIECE_SPACE) and not text.startswith(" "):
            text = " " + text
        return text.encode("utf-8")

    @property
    def adds_bos(self) -> bool:
        """Whether encoding text with special tokens puts the start token first."""
        return self.bos_token_id is not None and self.encode("a")[:1] == [self.bos_token_id]

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` ([{"role", "content"}, ...])."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _strftime_now(fmt: str) -> str:
    """The template global HF's ``apply_chat_template`` provides: the local time now, formatted
    (gpt-oss's template puts the date in its system message)."""
    return datetime.datetime.now().strftime(fmt)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to their own character, the other
    bytes, in order, to chr(256), chr(257), ..."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    others = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


def build_tiny_tokenizer() -> Tokenizer:
    """The built-in byte-level tokenizer (deterministic; see the module docstring)."""
    vocab = {ch: byte for byte, ch in gpt2_bytes_to_unicode().items()}
    # No word cache: the pre-tokenizer does not split the text (use_regex=False), so a "word" is a
    # whole text, and the cache (by default 10,000 words of under 256 characters, a few KiB each)
    # would keep every distinct short prompt, about 46 MiB of them once full; with no merges it
    # saves nothing.
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], cache_capacity=0))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    bos = TINY_SPECIAL_TOKENS[0]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tk.token_to_id(bos))]
    )
    return Tokenizer(tk, bos, [TINY_SPECIAL_TOKENS[1], TINY_SPECIAL_TOKENS[3]], TINY_CHAT_TEMPLATE)


def _token_text(token: Union[str, dict, None]) -> Optional[str]:
    """A tokenizer_config special token: a string or an AddedToken dict with "content"."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def load_tokenizer(path: Union[str, Path]) -> Tokenizer:
    """A HF tokenizer from a ``tokenizer.json`` file or a directory holding one. From the
    directory, if present: ``tokenizer_config.json`` (bos_token, eos_token, chat_template) and
    ``generation_config.json`` (eos_token_id: extra stop ids such as Llama-3's <|eot_id|>); the
    chat template from ``chat_template.jinja`` when tokenizer_config.json has none (gpt-oss)."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    file = directory / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {file}")
    tk = HFTokenizer.from_file(str(file))
    config: dict[str, Any] = {}
    if (directory / "tokenizer_config.json").is_file():
        config = json.loads((directory / "tokenizer_config.json").read_text())
    bos = _token_text(config.get("bos_token"))
    eos_tokens = [t for t in [_token_text(config.get("eos_token"))] if t is not None]
    if (directory / "generation_config.json").is_file():
        ids = json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")
        for token_id in ids if isinstance(ids, list) else ([ids] if ids is not None else []):
            token = tk.id_to_token(token_id)
            if token is not None and token not in eos_tokens:
                eos_tokens.append(token)
    template = config.get("chat_template")
    if template is None and (directory / CHAT_TEMPLATE_FILE).is_file():  # gpt-oss ships its template so
        template = (directory / CHAT_TEMPLATE_FILE).read_text()
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(tk, bos, eos_tokens, template)
