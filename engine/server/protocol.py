"""Request/response models of the served API subset: OpenAI completions and chat completions,
SGLang's /generate, and the OpenAI error body.

Requests validate strictly (no "1" -> 1 coercion); ``null`` means "the default". Every integer
must fit in int64, every float must be finite (no NaN or Infinity) and every string must be
valid Unicode (no lone surrogates), so the engine never sees a value it cannot hold. Fields a
client may send that this server cannot honour are rejected by `unsupported_fields` rather than
silently ignored; unknown extra fields are ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.scheduling.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

# OpenAI's error "type" per HTTP status (other 4xx: invalid_request_error, other 5xx: internal_error).
ERROR_TYPES = {404: "not_found_error", 503: "service_unavailable"}


def _valid_unicode(text: str) -> str:
    """``text`` if it encodes as UTF-8 (JSON's ``\\ud800`` escapes decode to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid Unicode ({exc.reason} at position {exc.start})") from None
    return text


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, AfterValidator(_valid_unicode)]


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "code"}}`` (``code``: the HTTP status)."""
    kind = ERROR_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": status}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[Text] = None
    max_tokens: Optional[Int64] = None
    temperature: Optional[Finite] = None
    top_p: Optional[Finite] = None
    top_k: Optional[Int64] = None  # extension (vLLM/SGLang)
    seed: Optional[Int64] = None
    stop: Union[Text, list[Text], None] = None
    stop_token_ids: Optional[list[Int64]] = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # Accepted only at their no-op values (see `unsupported_fields`).
    n: Optional[Int64] = None
    logprobs: Union[bool, Int64, None] = None
    presence_penalty: Optional[Finite] = None
    frequency_penalty: Optional[Finite] = None

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
    prompt: Union[Text, list[Int64], list[Text], list[list[Int64]]]
    echo: Optional[bool] = None
    best_of: Optional[Int64] = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.echo:
            bad.append("echo")
        if self.best_of not in (None, 1):
            bad.append("best_of")
        return bad


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Union[Text, list[TextPart]]

    def as_dict(self) -> dict[str, str]:
        """``{"role", "content"}`` with text parts joined, as chat templates expect."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[Int64] = None  # newer OpenAI name for max_tokens


class GenerateSamplingParams(_Strict):
    """SGLang's ``sampling_params`` (``max_new_tokens`` instead of ``max_tokens``)."""

    max_new_tokens: Optional[Int64] = None
    temperature: Optional[Finite] = None
    top_p: Optional[Finite] = None
    top_k: Optional[Int64] = None
    seed: Optional[Int64] = None
    stop: Union[Text, list[Text], None] = None
    stop_token_ids: Optional[list[Int64]] = None
    ignore_eos: bool = False

    def as_fields(self) -> SamplingFields:
        values = self.model_dump(exclude={"max_new_tokens"})
        return SamplingFields(max_tokens=self.max_new_tokens, **values)


class GenerateRequest(_Strict):
    text: Optional[Text] = None
    input_ids: Optional[list[Int64]] = None
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
