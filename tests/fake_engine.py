"""A deterministic fake `EngineClient` for the HTTP-layer tests (no model, no torch).

Tokenizer: one id per Latin-1 character (ids 0..255 = chr(id)), then BOS = 256 and EOS = 257.
``encode`` prepends BOS unless ``add_special_tokens=False``; ``decode`` drops both. The chat
template renders ``<role>content\\n`` (``<role name>`` with a name) per message and ends with
``<assistant>`` (with the generation prompt).

Generation: the reply to a prompt is its text (specials dropped) reversed, then EOS; with
``ignore_eos`` the reversed text repeats until ``max_tokens``. One token per chunk; EOS and
``stop_token_ids`` end with "stop" (their token counted, no text); a stop string ends with "stop"
and cuts the text before it, text that may begin a stop string is held back until it cannot;
``max_tokens`` ends with "length" (0: at once, no token). Log-probabilities (`fake_logprob`) come
with every token when ``logprobs`` is set, and for the prompt's tokens but the first in the first
chunk when ``prompt_logprobs`` is. Every submitted request is kept in ``requests``; a request that
ends without a finish_reason (closed by a client disconnect, or failed) is listed in ``aborted``.
``fail_after=k`` raises ``failure`` after k tokens (0: at once); `fail_all` ends every running
request with an error at its next token.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncGenerator, Iterator, Optional

from arfusion.engine.common.generation import GenerationChunk, TokenLogprob
from arfusion.engine.common.sampling_params import SamplingParams

BOS, EOS = 256, 257


class CharTokenizer:
    """Latin-1 characters as token ids, plus BOS and EOS."""

    vocab_size = 258
    eos_token_ids = (EOS,)
    bos_token, eos_token = "<s>", "</s>"
    adds_bos = True
    chat_template = "<role>content per message"
    special_tokens: dict[str, int] = {}  # BOS and EOS have no text that encodes to them

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("latin-1"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("latin-1")

    def encode_as_text(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        specials = {BOS: self.bos_token, EOS: self.eos_token}
        return specials[token_id].encode() if token_id in specials else chr(token_id).encode()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        turns = "".join(f"<{m['role']}{' ' + m['name'] if 'name' in m else ''}>{m['content']}\n" for m in messages)
        return turns + ("<assistant>" if add_generation_prompt else "")


def fake_logprob(token: int, top: int) -> TokenLogprob:
    """The fake's log-probability of ``token``: the most likely of its ``top`` alternatives."""
    logprob = -0.125 * (token % 7 + 1)
    return TokenLogprob(token, logprob, tuple(((token + j) % 256, logprob - j) for j in range(top)))


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class FakeEngine:
    """`EngineClient` with scripted output; ``fail_after=k`` raises ``failure`` after k tokens."""

    def __init__(self, context_length: int = 64, token_delay_s: float = 0.0) -> None:
        self.model_name = "fake-model"
        self.context_length = context_length
        self.tokenizer = CharTokenizer()
        self.token_delay_s = token_delay_s
        self.healthy = True
        self.fail_after: Optional[int] = None
        self.failure: Exception = RuntimeError("fake engine failure")
        self.ended_by: Optional[Exception] = None  # set by fail_all
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.aborted: list[int] = []  # indices into requests
        self.streams: list[AsyncGenerator[GenerationChunk, None]] = []
        self.running = 0
        self.max_running = 0  # most requests in flight at once
        self.flushes = 0

    @staticmethod
    def reply_ids(prompt_ids: list[int], ignore_eos: bool) -> Iterator[int]:
        reversed_ids = [i for i in reversed(prompt_ids) if i < 256]
        return itertools.cycle(reversed_ids) if ignore_eos else iter(reversed_ids + [EOS])

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncGenerator[GenerationChunk, None]:
        """The request's chunks; the generator is also kept in ``streams`` (as a scheduler keeps
        its requests), so garbage collection never closes it: only the server's explicit close."""
        stream = self._stream(list(prompt_ids), params)
        self.streams.append(stream)
        return stream

    async def _stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncGenerator[GenerationChunk, None]:
        index = len(self.requests)
        self.requests.append((prompt_ids, params))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        finished, text, emitted = False, "", 0
        k = params.logprobs
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [fake_logprob(t, params.prompt_logprobs) for t in prompt_ids[1:]]

        def chunk(text: str, token: int, done: int, finish: Optional[str]) -> GenerationChunk:
            nonlocal prompt_logprobs
            logprobs = None if k is None else [fake_logprob(token, k)]
            first, prompt_logprobs = prompt_logprobs, None
            return GenerationChunk(text, [token], len(prompt_ids), done, finish, logprobs, first)

        try:
            if params.max_tokens == 0:
                finished = True
                yield GenerationChunk("", [], len(prompt_ids), 0, "length", None if k is None else [],
                                      prompt_logprobs)
                return
            for step, token in zip(range(params.max_tokens), self.reply_ids(prompt_ids, params.ignore_eos)):
                await asyncio.sleep(self.token_delay_s)
                if self.fail_after == step:
                    raise self.failure
                if self.ended_by is not None:
                    raise self.ended_by
                done = step + 1
                if token in params.stop_token_ids or (token in self.tokenizer.eos_token_ids and not params.ignore_eos):
                    finished = True
                    yield chunk(text[emitted:], token, done, "stop")
                    return
                text += self.tokenizer.decode([token])
                hits = [text.find(s) for s in params.stop if s in text]
                if hits:
                    finished = True
                    yield chunk(text[emitted:min(hits)], token, done, "stop")
                    return
                finished = done == params.max_tokens
                end = len(text) if finished else len(text) - held_back(text, params.stop)
                yield chunk(text[emitted:end], token, done, "length" if finished else None)
                emitted = end
        finally:
            self.running -= 1
            if not finished:
                self.aborted.append(index)

    def fail_all(self, error: Exception) -> int:
        """End every running request with ``error``; returns how many were running."""
        self.ended_by = error
        return self.running

    async def flush_cache(self) -> bool:
        if self.running:
            return False
        self.flushes += 1
        return True

    def server_info(self) -> dict[str, Any]:
        return {"model": self.model_name, "context_length": self.context_length, "fusion": {"active": False}}

    def is_healthy(self) -> bool:
        return self.healthy

    def health_problem(self) -> Optional[str]:
        return None if self.healthy else "the fake engine is unhealthy"
