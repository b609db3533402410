"""Log-probabilities in OpenAI's response shapes, from the engine's `TokenLogprob`s.

/v1/completions (the legacy object; vLLM's conventions where OpenAI says nothing):

    {"tokens": [text], "token_logprobs": [logprob | null], "top_logprobs": [{text: logprob} | null],
     "text_offset": [int]}

one entry per token: with ``echo`` the prompt's tokens first (the first has no context: null),
then the output's. A ``top_logprobs`` dict holds the ``logprobs`` most likely tokens and the
chosen one; ``text_offset`` is where each token's text starts, the texts laid end to end from 0.
/v1/chat/completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}`` with the ``top_logprobs`` most likely tokens.

A token's text is its bytes decoded as UTF-8, or, for a piece of a character, OpenAI's
``"bytes:\\xNN..."``; a log-probability that is not finite is written as -9999.0 (JSON has no
infinity; OpenAI's floor).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from pydantic import BaseModel

from engine.common.generation import TokenizerLike, TokenLogprob

LOGPROB_FLOOR = -9999.0


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class TokenTexts:
    """Each token's bytes and text, looked up once per id (one per response)."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        if token_id not in self._bytes:
            self._bytes[token_id] = self.tokenizer.token_bytes(token_id)
        return self._bytes[token_id]

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[Optional[TokenLogprob]],
                        first_offset: int = 0) -> tuple[CompletionLogprobs, int]:
    """The legacy object for ``token_ids`` (None in ``logprobs``: a token with no log-probability,
    the first prompt token), text offsets counted from ``first_offset`` (a stream continues), and
    the offset after its last token."""
    tokens, values, tops, offsets = [], [], [], []
    offset = first_offset
    for token_id, entry in zip(token_ids, logprobs):
        text = texts.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_finite(entry.logprob))
        top: dict[str, float] = {}
        for alt, logprob in (*entry.top, (token_id, entry.logprob)):
            top.setdefault(texts.text(alt), _finite(logprob))
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets), offset


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    """``logprobs.content`` of a chat choice or chunk."""
    def entry(token_id: int, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=texts.text(token_id), logprob=_finite(logprob), bytes=list(texts.bytes(token_id)))

    content = [ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(),
                                top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in logprobs]
    return ChatLogprobs(content=content)
