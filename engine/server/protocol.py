"""Request/response models of the served API subset: OpenAI completions and chat completions,
SGLang's /generate, and the OpenAI error body.

Requests validate strictly (no "1" -> 1 coercion); ``null`` means "the default". Fields a client
may send that this server cannot honour are rejected by `unsupported_fields` rather than
silently ignored; unknown extra fields are ignored.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from engine.scheduling.sampling_params import SamplingParams

# OpenAI's error "type" per HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "code": status}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # extension (vLLM/SGLang)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # Accepted only at their no-op values (see `unsupported_fields`).
    n: Optional[int] = None
    logprobs: Union[bool, int, None] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """`SamplingParams` for this request; raises ValueError (naming the field) on bad values."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if "" in stop:
            raise ValueError("stop strings must not be empty")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )

    def unsupported_fields(self) -> list[str]:
        """Names of fields set to a value this server cannot honour."""
        bad = []
        if self.n not in (None, 1):
            bad.append("n (only n=1 is supported)")
        if self.logprobs not in (None, False, 0):
            bad.append("logprobs")
        bad += [f for f in ("presence_penalty", "frequency_penalty") if getattr(self, f) not in (None, 0)]
        return bad


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: Optional[bool] = None
    best_of: Optional[int] = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.echo:
            bad.append("echo")
        if self.best_of not in (None, 1):
            bad.append("best_of")
        return bad


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def as_dict(self) -> dict[str, str]:
        """``{"role", "content"}`` with text parts joined, as chat templates expect."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None  # newer OpenAI name for max_tokens


class GenerateSamplingParams(_Strict):
    """SGLang's ``sampling_params`` (``max_new_tokens`` instead of ``max_tokens``)."""

    max_new_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False

    def as_fields(self) -> SamplingFields:
        values = self.model_dump(exclude={"max_new_tokens"})
        return SamplingFields(max_tokens=self.max_new_tokens, **values)


class GenerateRequest(_Strict):
    text: Optional[str] = None
    input_ids: Optional[list[int]] = None
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()
    stream: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Optional[str]
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: Optional[str]
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": "assistant"} first, then {"content": ...}, {} at the end
    finish_reason: Optional[str] = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
