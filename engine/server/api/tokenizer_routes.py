"""The tokenizer endpoints, in vLLM's request and response shapes, so that clients (evaluation
harnesses, context budgeting) count tokens with the server's own tokenizer:

    POST /tokenize       {"prompt": str, "add_special_tokens": true}
                         or {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}
                         -> {"count", "max_model_len", "tokens", "token_strs"}   ("return_token_strs": true)
    POST /detokenize     {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> the special tokens, whether text prompts get the start token
                            (``add_bos_token``), the vocabulary size, the context length, the chat template

Messages are rendered with the chat template exactly as /v1/chat/completions renders them. Work
proportional to the text runs in a worker thread, off the event loop. Errors: 400 naming the
problem (a token id outside the vocabulary, a message this server cannot render, no messages,
both ``prompt`` and ``messages``), 404 for another model's name.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Union

from fastapi import FastAPI

from arfusion.engine.server.api.engine_client import EngineClient
from arfusion.engine.server.api.logprobs_format import TokenTexts
from arfusion.engine.server.api.protocol import APIError, ChatMessage, Int64, Text, RequestBody
from arfusion.engine.tokenizers.chat_encoding import encode_chat


class TokenizeCompletionRequest(RequestBody):
    model: Optional[Text] = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestBody):
    model: Optional[Text] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    continue_final_message: bool = False
    tools: Optional[Any] = None
    chat_template: Optional[Any] = None

    def problems(self) -> list[str]:
        bad = [p for i, m in enumerate(self.messages) for p in m.problems(i)]
        if self.continue_final_message:
            bad.append("continue_final_message (not implemented)")
        if self.tools:
            bad.append("tools (this server does no tool calling)")
        if self.chat_template is not None:
            bad.append("chat_template (only the model's own)")
        return bad


class DetokenizeRequest(RequestBody):
    model: Optional[Text] = None
    tokens: list[Int64]


def add_tokenizer_routes(app: FastAPI, engine: EngineClient, served_model_name: str,
                         allow_special_tokens_in_messages: bool = False) -> None:
    """Add /tokenize, /detokenize and /tokenizer_info for ``engine``'s tokenizer to ``app``;
    messages are encoded as /v1/chat/completions encodes them (`encode_chat`)."""
    tokenizer = engine.tokenizer

    def check_model(model: Optional[str]) -> None:
        if model is not None and model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{served_model_name}`")

    def tokenize_text(req: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> list[int]:
        if isinstance(req, TokenizeCompletionRequest):
            return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        try:
            return encode_chat(tokenizer, [m.as_dict() for m in req.messages], req.add_generation_prompt,
                               req.add_special_tokens, allow_special_tokens_in_messages)
        except Exception as exc:  # a template's raise_exception, or no template at all
            raise APIError(400, f"cannot apply the chat template: {exc}") from exc

    @app.post("/tokenize")
    async def tokenize(req: Union[TokenizeChatRequest, TokenizeCompletionRequest]) -> dict[str, Any]:
        check_model(req.model)
        other = "prompt" if isinstance(req, TokenizeChatRequest) else "messages"
        if (req.model_extra or {}).get(other) is not None:
            raise APIError(400, "give either prompt or messages, not both")
        if isinstance(req, TokenizeChatRequest) and not req.messages:
            raise APIError(400, "messages must not be empty")  # as /v1/chat/completions
        if isinstance(req, TokenizeChatRequest) and req.problems():
            raise APIError(400, f"not supported: {', '.join(req.problems())}")
        ids = await asyncio.to_thread(tokenize_text, req)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}
        if req.return_token_strs:
            texts = TokenTexts(tokenizer)
            body["token_strs"] = await asyncio.to_thread(lambda: [texts.text(i) for i in ids])
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids out of range [0, {tokenizer.vocab_size}): {bad[:8]}")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "eos_token_ids": list(tokenizer.eos_token_ids),
            "add_bos_token": tokenizer.adds_bos,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": engine.context_length,
            "chat_template": tokenizer.chat_template,
        }
