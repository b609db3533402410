"""What a request gets back from the engine (`GenerationChunk`s with their `TokenLogprob`s, or
an `EngineError` whose status its client is answered) and the tokenizer interface
(`TokenizerLike`) the scheduler and the server detokenize with."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


class EngineError(Exception):
    """A request ended without its output: ``status`` 400 (the engine cannot take this input),
    500 (a fault while serving it, or a failed engine), 503 (the engine is shutting down)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's distribution, with the most likely tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


@dataclass
class GenerationChunk:
    """New output since the previous chunk of the same request."""

    text: str  # detokenized text delta (stop strings already cut)
    token_ids: list[int]  # new output token ids
    prompt_tokens: int
    completion_tokens: int  # output tokens so far
    finish_reason: Optional[str] = None  # None while running; "stop" or "length" or "abort" at the end
    logprobs: Optional[list[TokenLogprob]] = None  # one per token id, when the request asked for them
    # the first chunk of a request that asked for them: one per prompt token but the first
    prompt_logprobs: Optional[list[TokenLogprob]] = None


class TokenizerLike(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token: Optional[str]
    eos_token: Optional[str]
    adds_bos: bool  # encoding text with special tokens puts bos_token first
    chat_template: Optional[str]
    special_tokens: dict[str, int]  # text -> id of every special (control) token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...  # the raw bytes one token stands for
    def encode_as_text(self, text: str) -> list[int]: ...  # special tokens' text as plain text
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...
