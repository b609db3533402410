"""Incremental detokenization that continues the prompt's text, as HF's and vLLM's detokenizers
do (prefix offset / read offset).

A request's output text is ``decode(prompt + output) - decode(prompt)`` (the second a prefix of
the first), never ``decode(output)``: decoders treat the start of a text specially (SentencePiece
drops the space of the first word, ``"▁Paris"`` -> ``"Paris"``), so the output, which continues
the prompt, must be decoded after it. Decoding the whole prompt per token would cost O(prompt);
the decoder only looks at the tokens' own pieces, so a few prompt tokens whose text is not empty
(`prompt_context`) stand for the prompt, and each step decodes a short window:

    new text = decode(ids[prefix:]) - decode(ids[prefix:read])

over ``ids = context + output``, moving ``prefix, read = read, len(ids)`` whenever it yields
text. A window whose text ends in U+FFFD (a character split over tokens) waits for more ids,
unless the output is final.
"""
from __future__ import annotations

from typing import Sequence

from arfusion.engine.common.generation import TokenizerLike

CONTEXT_TOKENS = 5  # the prompt tokens a decode starts from at least (vLLM's and HF's number)
_REPLACEMENT = "\ufffd"


def prompt_context(tokenizer: TokenizerLike, prompt_ids: Sequence[int]) -> list[int]:
    """The prompt's last tokens that the output's text is decoded after: at least
    ``CONTEXT_TOKENS``, doubled until their text is not empty and holds no U+FFFD (it begins on a
    character and not with tokens decoding leaves out: after only special tokens a SentencePiece
    decoder would drop the output's first space), or the whole prompt."""
    n = min(CONTEXT_TOKENS, len(prompt_ids))
    while n < len(prompt_ids):
        text = tokenizer.decode(list(prompt_ids[-n:]))
        if text and _REPLACEMENT not in text:
            break
        n = min(2 * n, len(prompt_ids))
    return list(prompt_ids[len(prompt_ids) - n:])


def output_starts_text(tokenizer: TokenizerLike, prompt_ids: Sequence[int]) -> bool:
    """Whether the output's text begins a text: the prompt decodes to nothing (say, only a BOS),
    so the decoder treats the output's first token as the start of a text."""
    return not tokenizer.decode(prompt_context(tokenizer, prompt_ids))


class IncrementalDetokenizer:
    """One request's output text, token by token (the module docstring)."""

    def __init__(self, tokenizer: TokenizerLike, prompt_ids: Sequence[int]) -> None:
        self.context = prompt_context(tokenizer, prompt_ids)
        self.prefix_offset = 0  # into context + output
        self.read_offset = len(self.context)

    def _ids(self, start: int, output_ids: Sequence[int], end: int) -> list[int]:
        """``(context + output_ids)[start:end]`` without joining the two."""
        c = len(self.context)
        return self.context[start:end] + list(output_ids[max(start - c, 0):max(end - c, 0)])

    def new_text(self, tokenizer: TokenizerLike, output_ids: Sequence[int], final: bool) -> str:
        """The text that ``output_ids`` (all of them so far, growing from call to call) add to
        what earlier calls returned; moves the window past it."""
        end = len(self.context) + len(output_ids)
        prefix_text = tokenizer.decode(self._ids(self.prefix_offset, output_ids, self.read_offset))
        full_text = tokenizer.decode(self._ids(self.prefix_offset, output_ids, end))
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, end
        return full_text[len(prefix_text):]
