"""Chat messages to token ids, with message text tokenized as text: a special (control) token
such as ``<|im_start|>`` comes only from the chat template itself, never from what a caller
wrote in a message's ``content`` or ``name``, so no caller can forge a turn of another role.

How: when no message text holds a special token's text, the rendered prompt is encoded as it
is (exactly the ids of before). Otherwise the template is rendered a second time with each
message text replaced by a placeholder (a random nonce and the text's index); the template's
own special tokens are the ones in that rendering, outside the placeholders. The prompt is then
the template's special tokens as their ids, and everything between them (template text and the
message texts put back in place of their placeholders) encoded with special-token matching off
(`encode_as_text`). The text between two template special tokens is encoded as one piece, as
the tokenizer itself does, so token boundaries match a plain encoding wherever the content
holds no special token. A template whose output with the texts put back differs from its plain
rendering (it cuts, slices or tests a message's text) cannot be rendered so: ValueError naming that.

``allow_special_tokens`` (the server's ``--allow-special-tokens-in-messages``, for trusted
callers only) encodes the rendered prompt as it is, special tokens in messages included.
"""
from __future__ import annotations

import re
import secrets
from typing import Any, Protocol, Sequence

USER_TEXT_FIELDS = ("content", "name")  # the message fields a caller writes freely (role is checked)


class ChatTokenizer(Protocol):
    special_tokens: dict[str, int]  # text -> id of every special token

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_as_text(self, text: str) -> list[int]: ...


def encode_chat(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                add_special_tokens: bool = False, allow_special_tokens: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template (see the module docstring).
    ``add_special_tokens`` adds what the tokenizer's post-processor adds to a text (a BOS
    for most; the template usually holds it already). Raises what the template raises."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
    specials = tokenizer.special_tokens
    user_texts = [m[f] for m in messages for f in USER_TEXT_FIELDS if isinstance(m.get(f), str)]
    if allow_special_tokens or not any(s in t for t in user_texts for s in specials):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    prefix = tokenizer.encode("", add_special_tokens=True) if add_special_tokens else []
    return prefix + _encode_marked(tokenizer, list(messages), add_generation_prompt, text)


def _encode_marked(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
                   text: str) -> list[int]:
    """The template rendered with placeholders for the message texts, then encoded: template
    special tokens as ids, every other stretch (message texts put back) as text. ``text``: the
    plain rendering, which the placeholders' rendering with the texts put back must equal."""
    nonce = secrets.token_hex(8)
    texts: list[str] = []
    marked = []
    for message in messages:
        copy = dict(message)
        for f in USER_TEXT_FIELDS:
            if isinstance(message.get(f), str):
                copy[f] = f"[{nonce}:{len(texts)}]"
                texts.append(message[f])
        marked.append(copy)
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt)
    parts = re.split(rf"\[{nonce}:(\d+)\]", rendered)  # template text, text index, template text, ...
    if "".join(texts[int(p)] if i % 2 else p for i, p in enumerate(parts)) != text:
        raise ValueError("the chat template changes message text that holds a special token's text, so "
                         "that text cannot be kept apart from the template's own special tokens")
    specials = tokenizer.special_tokens
    special = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
    ids: list[int] = []
    pending: list[str] = []  # text since the last template special token
    for i, part in enumerate(parts):
        if i % 2:
            pending.append(texts[int(part)])
            continue
        for j, piece in enumerate(special.split(part)):
            if j % 2:
                ids += tokenizer.encode_as_text("".join(pending))
                ids.append(specials[piece])
                pending = []
            else:
                pending.append(piece)
    return ids + tokenizer.encode_as_text("".join(pending))
