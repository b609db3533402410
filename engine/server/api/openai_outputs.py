"""The parts of OpenAI responses that depend on what a request asked for beyond text: the echoed
prompt and the log-probabilities (`engine.server.api.logprobs_format`), whole or chunk by chunk.

`Collected` gathers a non-streaming request's chunks. `CompletionOutput` builds /v1/completions
choices: ``echo`` puts the prompt's text (its string as sent, or its token ids decoded) and,
with ``logprobs``, its tokens' log-probabilities before the output's; a stream sends the echo
as its first event. `chat_logprobs_of` gives a chat choice's or chunk's ``logprobs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from arfusion.engine.common.generation import GenerationChunk, TokenizerLike, TokenLogprob
from arfusion.engine.scheduling.detokenizer import output_starts_text
from arfusion.engine.server.api.logprobs_format import (
    ChatLogprobs, CompletionLogprobs, TextOffsets, TokenTexts, chat_logprobs, completion_logprobs,
)
from arfusion.engine.server.api.protocol import CompletionChoice


@dataclass
class Collected:
    """A whole output: its text, token ids, log-probabilities (if asked for), the prompt's, and
    the last chunk (finish reason, usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: Optional[list[TokenLogprob]] = None
    last: Optional[GenerationChunk] = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.last = chunk


def prompt_text(prompt: Any, prompt_ids: list[int], tokenizer: TokenizerLike) -> str:
    """The text a completions ``prompt`` echoes: the string sent (alone or in a one-element
    batch), else its token ids decoded."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)


class CompletionOutput:
    """/v1/completions choices for one request (the module docstring)."""

    def __init__(self, tokenizer: TokenizerLike, prompt: Any, prompt_ids: list[int], echo: bool,
                 logprobs: Optional[int]) -> None:
        self.texts = TokenTexts(tokenizer)
        self.prompt_ids = prompt_ids
        self.echo = echo
        self.wants_logprobs = logprobs is not None
        self.echo_text = prompt_text(prompt, prompt_ids, tokenizer) if echo else ""
        self.offsets = TextOffsets()  # where the next token's text begins
        self.text_len = 0  # characters of the choice's text sent so far (a stream)
        self.output_begun = False

    @property
    def extra(self) -> bool:
        """Whether the choices hold more than the engine's text (building them takes a while)."""
        return self.echo or self.wants_logprobs

    def whole(self, out: Collected) -> CompletionChoice:
        """The choice of a non-streaming request."""
        assert out.last is not None
        text = self.echo_text + out.text
        legacy = self._echo_legacy(out.prompt_logprobs, len(self.echo_text))
        output = self._output_legacy(out.token_ids, list(out.logprobs), len(text))
        if legacy is not None and output is not None:
            legacy = CompletionLogprobs(**{key: getattr(legacy, key) + getattr(output, key)
                                           for key in CompletionLogprobs.model_fields})
        return CompletionChoice(text=text, finish_reason=out.last.finish_reason,
                                logprobs=legacy if self.echo else output)

    def echoed(self, first: GenerationChunk) -> Optional[CompletionChoice]:
        """A stream's first event with ``echo``: the prompt (None without echo)."""
        if not self.echo:
            return None
        self.text_len = len(self.echo_text)
        return CompletionChoice(text=self.echo_text, finish_reason=None,
                                logprobs=self._echo_legacy(first.prompt_logprobs, self.text_len))

    def chunk(self, chunk: GenerationChunk) -> Optional[CompletionChoice]:
        """A stream's event for ``chunk``; None when it has nothing to send."""
        if not (chunk.text or chunk.finish_reason or (self.wants_logprobs and chunk.token_ids)):
            return None
        self.text_len += len(chunk.text)
        return CompletionChoice(text=chunk.text, finish_reason=chunk.finish_reason,
                                logprobs=self._output_legacy(chunk.token_ids, chunk.logprobs or [], self.text_len))

    def _echo_legacy(self, prompt_logprobs: Optional[list[TokenLogprob]], text_end: int) -> Optional[CompletionLogprobs]:
        """The prompt's tokens (with echo and logprobs): None for the first (no context), then
        the engine's entries; the echoed text begins at 0."""
        if not (self.echo and self.wants_logprobs):
            return None
        self.offsets.begin_text(0, known=self.echo_text)
        entries = [None, *(prompt_logprobs or [])]
        return completion_logprobs(self.texts, self.offsets, self.prompt_ids, entries, text_end)

    def _output_legacy(self, ids: list[int], logprobs: list[Optional[TokenLogprob]],
                       text_end: int) -> Optional[CompletionLogprobs]:
        """Output tokens, continuing the offsets (None without logprobs). The engine decodes the
        output after the prompt's text: it begins after the echo, and a text only where the
        prompt decodes to nothing."""
        if not self.wants_logprobs:
            return None
        if not self.output_begun:
            self.offsets.begin_text(len(self.echo_text), at_start=output_starts_text(self.texts.tokenizer, self.prompt_ids))
            self.output_begun = True
        return completion_logprobs(self.texts, self.offsets, ids, logprobs, text_end)


def chat_logprobs_of(texts: TokenTexts, logprobs: Optional[list[TokenLogprob]]) -> Optional[ChatLogprobs]:
    """A chat choice's or chunk's ``logprobs`` (None when the request asked for none)."""
    return None if logprobs is None else chat_logprobs(texts, logprobs)
