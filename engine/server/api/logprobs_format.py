"""Log-probabilities in OpenAI's response shapes, from the engine's `TokenLogprob`s.

/v1/completions (the legacy object; vLLM's conventions where OpenAI says nothing):

    {"tokens": [text], "token_logprobs": [logprob | null], "top_logprobs": [{text: logprob} | null],
     "text_offset": [int]}

one entry per token: with ``echo`` the prompt's tokens first (the first has no context: null),
then the output's. A ``top_logprobs`` dict holds the ``logprobs`` most likely tokens and the
chosen one (first). ``text_offset`` indexes into the choice's ``text`` (`TextOffsets`), for
every tokenizer: the tokens' texts laid end to end at their offsets are the text. A token that
is not in the text (a BOS, a special token decoding leaves out, a stop token) has the empty text,
at the offset where the next text begins (a leading BOS: 0), as vLLM shows it; a token at the
start of a text whose leading space the decoder drops (SentencePiece's word-start mark) is shown
without it; a byte that is no UTF-8 in an echoed text stands as the U+FFFD it decoded to; the
pieces of a character split over tokens are each at the character's offset. No offset passes the
end of the text sent so far (the tokens of a stop string that cut the text are at its end).
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

from arfusion.engine.common.generation import TokenizerLike, TokenLogprob

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
        self._alone: dict[int, str] = {}
        self._unknown: set[int] = set()  # ids the tokenizer lacks

    def bytes(self, token_id: int) -> bytes:
        """The token's bytes; none for an id the tokenizer lacks (a row padding the model's
        vocabulary: decoding leaves it out)."""
        if token_id not in self._bytes:
            try:
                self._bytes[token_id] = self.tokenizer.token_bytes(token_id)
            except ValueError:
                self._bytes[token_id] = b""
                self._unknown.add(token_id)
        return self._bytes[token_id]

    def text(self, token_id: int) -> str:
        return _shown(self.bytes(token_id))

    def in_text(self, token_id: int, at_start: bool) -> bytes:
        """The bytes ``token_id`` puts into a decoded text: none for a token decoding leaves out
        (its text alone decodes to nothing though it stands for more than spaces: a special
        token), its bytes without their leading space at the ``at_start`` of a text whose decoder
        drops it there (SentencePiece), else its bytes."""
        raw = self.bytes(token_id)
        alone = self.decoded_alone(token_id)
        if not alone and raw.strip():
            return b""
        if at_start and raw.startswith(b" ") and not alone.startswith(" "):
            return raw[1:]
        return raw

    def is_skipped(self, token_id: int) -> bool:
        """Whether decoding leaves the token out of a text (a special token, an id the tokenizer lacks)."""
        return not self.decoded_alone(token_id) and (bool(self.bytes(token_id).strip()) or token_id in self._unknown)

    def shown(self, token_id: int, at_start: bool) -> str:
        """The token's text in the legacy object: its text as it stands in a decoded text
        (`in_text`), or, for a piece of a character, OpenAI's ``"bytes:\\xNN"``."""
        return _shown(self.in_text(token_id, at_start))

    def decoded_alone(self, token_id: int) -> str:
        """The token decoded on its own (special tokens left out, a piece of a character as U+FFFD)."""
        if token_id not in self._alone:
            self._alone[token_id] = self.tokenizer.decode([token_id])
        return self._alone[token_id]


def _shown(raw: bytes) -> str:
    """``raw`` decoded as UTF-8, or OpenAI's ``"bytes:\\xNN..."`` for a piece of a character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token begins in a /v1/completions choice's text, token by token, across the
    chunks of a stream (the module docstring). Offsets count characters: a token's offset is
    that of the character its first byte belongs to.

    A text known whole when its tokens are placed (an echoed prompt: the string as sent, or its
    ids decoded) is matched: a token stands where its bytes (or, at the start of a word the
    decoder begins, its bytes without their leading space) come next in the text, else it is
    not in the text (a BOS, a special token decoding left out). The output, whose text arrives
    with its tokens, is placed by how decoding treats each token (`TokenTexts.in_text`)."""

    def __init__(self) -> None:
        self.chars = 0  # characters begun by the tokens placed so far
        self.at_start = True  # no token of the current text placed yet (skipped ones aside)
        self._known: Optional[bytes] = None  # the current text's bytes, when known whole
        self._pos = 0  # bytes of it placed so far

    def begin_text(self, offset: int, known: Optional[str] = None, at_start: bool = True) -> None:
        """A separately decoded text begins at ``offset``: the echoed prompt (``known``, whole)
        at 0, or the output after it (``at_start``: whether the decoder begins a text with it,
        i.e. the prompt decodes to nothing; else the output continues the prompt's text)."""
        self.chars, self.at_start = offset, at_start
        self._known, self._pos = (known.encode("utf-8"), 0) if known is not None else (None, 0)

    def place(self, texts: TokenTexts, token_id: int) -> tuple[str, int]:
        """The next token's text as shown and its offset; moves past the token."""
        piece = self._matched(texts, token_id) if self._known is not None else texts.in_text(token_id, self.at_start)
        if piece or not texts.is_skipped(token_id):
            self.at_start = False
        continues = bool(piece) and _CONTINUATION_FIRST <= piece[0] <= _CONTINUATION_LAST
        offset = self.chars - 1 if continues and self.chars > 0 else self.chars
        self.chars += sum(1 for b in piece if not _CONTINUATION_FIRST <= b <= _CONTINUATION_LAST)
        return _shown(piece), offset

    def _matched(self, texts: TokenTexts, token_id: int) -> bytes:
        """What of the token comes next in the known text (moving past it): its bytes, those
        without a leading space, its text decoded alone (U+FFFD for a byte that is no UTF-8 in
        the text), or nothing (the token is not in the text)."""
        assert self._known is not None
        raw = texts.bytes(token_id)
        for piece in (raw, raw[1:] if raw.startswith(b" ") else b"", texts.decoded_alone(token_id).encode("utf-8")):
            if piece and self._known.startswith(piece, self._pos):
                self._pos += len(piece)
                return piece
        return b""


_CONTINUATION_FIRST, _CONTINUATION_LAST = 0x80, 0xBF  # UTF-8 bytes that continue a character


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def completion_logprobs(texts: TokenTexts, offsets: TextOffsets, token_ids: Sequence[int],
                        logprobs: Sequence[Optional[TokenLogprob]], text_end: int) -> CompletionLogprobs:
    """The legacy object for ``token_ids`` (None in ``logprobs``: a token with no log-probability,
    the first prompt token), placed by ``offsets`` (which moves past them) in a text of
    ``text_end`` characters so far (no offset passes it)."""
    tokens, values, tops, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        at_start = offsets.at_start
        shown, offset = offsets.place(texts, token_id)
        tokens.append(shown)
        text_offset.append(min(offset, text_end))
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_finite(entry.logprob))
        top = {shown: _finite(entry.logprob)}  # the chosen token, then the others (a text shown once)
        for alt, logprob in entry.top:
            if alt != token_id:
                top.setdefault(texts.shown(alt, at_start), _finite(logprob))
        tops.append(top)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=text_offset)


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    """``logprobs.content`` of a chat choice or chunk."""
    def entry(token_id: int, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=texts.text(token_id), logprob=_finite(logprob), bytes=list(texts.bytes(token_id)))

    content = [ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(),
                                top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in logprobs]
    return ChatLogprobs(content=content)
