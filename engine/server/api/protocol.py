"""Request/response models of the served API subset: OpenAI completions and chat completions,
SGLang's /generate, and the OpenAI error body.

Requests validate strictly (no "1" -> 1 coercion); ``null`` means "the default". Every integer
must fit in int64, every float must be finite (no NaN or Infinity) and every string must be
valid Unicode (no lone surrogates), so the engine never sees a value it cannot hold. A list
bounded by the engine (``stop``, ``stop_token_ids``) is counted before its items are validated,
and refused at once with the engine's error naming the field (a `REQUEST_LIMIT` error): a body of
40,000 stop strings costs its JSON parse and a ``len``, not the validation of 40,000 strings. Every
documented OpenAI field is honoured, inert, or, at a value this server cannot honour, rejected
by `unsupported_fields` (`engine.server.api.openai_fields`) rather than silently ignored; fields
neither OpenAI nor vLLM documents are ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from arfusion.engine.common.sampling_params import (
    INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
    SamplingParams, stop_string_length_error, too_many_stop_strings, too_many_stop_token_ids,
)
from arfusion.engine.server.api.logprobs_format import ChatLogprobs, CompletionLogprobs
from arfusion.engine.server.api.openai_fields import (
    CHAT_LIMITED, COMMON_LIMITED, COMPLETION_LIMITED, EXTENSIONS_LIMITED, NO_TOOLS, refused,
)
from arfusion.engine.server.http.errors import error_body


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
REQUEST_LIMIT = "request_limit"  # the error type of a field over its limit; its message names the field


def _over_limit(message: str) -> PydanticCustomError:
    return PydanticCustomError(REQUEST_LIMIT, "{message}", {"message": message})


def _stop_within_limits(value: Any) -> Any:
    """``stop`` as given (a string or a list, its items not yet validated), unless it has more
    than ``MAX_STOP_STRINGS`` strings or one of more than ``MAX_STOP_STRING_CHARS`` characters."""
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    if len(stops) > MAX_STOP_STRINGS:
        raise _over_limit(too_many_stop_strings(len(stops)))
    long = next((s for s in stops if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS), None)
    if long is not None:
        raise _over_limit(stop_string_length_error(len(long)))
    return value


def _stop_token_ids_within_limit(value: Any) -> Any:
    """``stop_token_ids`` as given, unless it is a list of more than ``MAX_STOP_TOKEN_IDS`` items."""
    if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:
        raise _over_limit(too_many_stop_token_ids(len(value)))
    return value


Stop = Annotated[Union[Text, list[Text], None], BeforeValidator(_stop_within_limits)]
StopTokenIds = Annotated[Optional[list[Int64]], BeforeValidator(_stop_token_ids_within_limit)]


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class RequestBody(BaseModel):
    """A request body: extra fields are kept (unvalidated) so that `openai_fields` can refuse
    the known ones it cannot honour; the others are ignored."""

    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (`openai_fields` says
    what happens with each)."""

    model: Optional[Text] = None
    max_tokens: Optional[Int64] = None
    temperature: Optional[Finite] = None
    top_p: Optional[Finite] = None
    top_k: Optional[Int64] = None  # extension (vLLM/SGLang)
    seed: Optional[Int64] = None
    stop: Stop = None
    stop_token_ids: StopTokenIds = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: Optional[Int64] = None  # extension
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Finite] = None
    frequency_penalty: Optional[Finite] = None
    repetition_penalty: Optional[Finite] = None  # extension
    logit_bias: Optional[dict[str, Finite]] = None  # token id (as a string) -> bias, clamped to [-100, 100]
    user: Optional[Text] = None  # inert
    n: Optional[Any] = None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprob_counts(self) -> tuple[Optional[int], Optional[int]]:
        """``(alternatives per output token, per prompt token)`` asked for; None: no log-probabilities."""
        return None, None

    def sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """`SamplingParams` for this request; raises ValueError (naming the field) on bad values,
        among them a logit_bias or stop_token_ids id outside ``[0, vocab_size)``."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if "" in stop:
            raise ValueError("stop strings must not be empty")
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=stop_token_ids(self.stop_token_ids or [], vocab_size),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens or 0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=logit_bias_pairs(self.logit_bias or {}, vocab_size),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def unsupported_fields(self) -> list[str]:
        """Names (and why) of fields set to a value this server cannot honour."""
        return refused({**(self.model_extra or {}), "n": self.n}, {**COMMON_LIMITED, **EXTENSIONS_LIMITED})


def logit_bias_pairs(bias: dict[str, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id strings -> bias) as sorted (id, bias) pairs, each bias
    clamped to [-100, 100] as OpenAI does; ValueError naming logit_bias for a key that is not a
    token id of the vocabulary."""
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.strip().isdigit()):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        token = int(key)
        if token >= vocab_size:
            raise ValueError(f"logit_bias: token id {token} is out of range [0, {vocab_size})")
        pairs.append((token, max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, value))))
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token id twice")
    return tuple(sorted(pairs))


def stop_token_ids(ids: list[int], vocab_size: int) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids`` (at most ``MAX_STOP_TOKEN_IDS``: checked at validation) as a
    tuple; ValueError naming stop_token_ids for one that is not a token id of the vocabulary."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids: token ids out of range [0, {vocab_size}): {bad[:8]}")
    return tuple(ids)


class CompletionRequest(SamplingFields):
    prompt: Union[Text, list[Int64], list[Text], list[list[Int64]]]
    echo: Optional[bool] = None
    logprobs: Optional[Int64] = None  # alternatives per token (0: the chosen token's log-probability only)
    best_of: Optional[Any] = None
    suffix: Optional[Any] = None

    def logprob_counts(self) -> tuple[Optional[int], Optional[int]]:
        return self.logprobs, self.logprobs if self.echo else None

    def unsupported_fields(self) -> list[str]:
        return super().unsupported_fields() + refused({"best_of": self.best_of, "suffix": self.suffix},
                                                      COMPLETION_LIMITED)


class ContentPart(_Strict):
    type: Text
    text: Optional[Text] = None


class ChatMessage(_Strict):
    """A chat message; ``developer`` is a system message (OpenAI's newer name); ``name`` is
    given to the chat template. Tool and function messages and calls are refused."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[Text, list[ContentPart], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    refusal: Optional[Any] = None

    def problems(self, index: int) -> list[str]:
        """What in this message (``messages[index]``) cannot be honoured."""
        where = f"messages[{index}]"
        bad = [f"{where}.role {self.role!r} ({NO_TOOLS})"] if self.role in ("tool", "function") else []
        bad += [f"{where}.{f} ({NO_TOOLS if f != 'audio' else 'text only'})"
                for f in ("tool_calls", "function_call", "audio") if getattr(self, f) is not None]
        if self.refusal is not None:
            bad.append(f"{where}.refusal (give a refusal as content)")
        if self.content is None:
            bad.append(f"{where}.content (missing)")
        elif not isinstance(self.content, str):
            bad += [f"{where}.content[{i}].type {p.type!r} (text parts only)"
                    for i, p in enumerate(self.content) if p.type != "text"]
            bad += [f"{where}.content[{i}].text (missing)"
                    for i, p in enumerate(self.content) if p.type == "text" and p.text is None]
        return bad

    def as_dict(self) -> dict[str, str]:
        """``{"role", "content"}`` (and ``name``) with text parts joined, as chat templates expect."""
        content = self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content or [])
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return message if self.name is None else {**message, "name": self.name}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[Int64] = None  # newer OpenAI name for max_tokens
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Int64] = None  # alternatives per token (needs logprobs)
    metadata: Optional[Any] = None  # inert
    safety_identifier: Optional[Any] = None  # inert
    prompt_cache_key: Optional[Any] = None  # inert
    parallel_tool_calls: Optional[Any] = None  # inert
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    response_format: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[Any] = None
    verbosity: Optional[Any] = None
    web_search_options: Optional[Any] = None
    service_tier: Optional[Any] = None
    store: Optional[Any] = None

    def logprob_counts(self) -> tuple[Optional[int], Optional[int]]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def unsupported_fields(self) -> list[str]:
        own = {name: rule for name, rule in CHAT_LIMITED.items() if name not in COMMON_LIMITED}  # those: super's
        bad = super().unsupported_fields() + refused({name: getattr(self, name) for name in own}, own)
        return bad + [p for i, m in enumerate(self.messages) for p in m.problems(i)]


class GenerateSamplingParams(RequestBody):
    """SGLang's ``sampling_params`` (``max_new_tokens`` instead of ``max_tokens``,
    ``min_new_tokens`` instead of ``min_tokens``); a field it does not list is refused by name
    (`unknown_fields`), never ignored."""

    max_new_tokens: Optional[Int64] = None
    min_new_tokens: Optional[Int64] = None
    temperature: Optional[Finite] = None
    top_p: Optional[Finite] = None
    top_k: Optional[Int64] = None
    seed: Optional[Int64] = None
    stop: Stop = None
    stop_token_ids: StopTokenIds = None
    ignore_eos: bool = False
    presence_penalty: Optional[Finite] = None
    frequency_penalty: Optional[Finite] = None
    repetition_penalty: Optional[Finite] = None
    logit_bias: Optional[dict[str, Finite]] = None

    def unknown_fields(self) -> list[str]:
        """``"sampling_params.NAME (unknown)"`` for each field this server does not know."""
        return [f"sampling_params.{name} (unknown)" for name in self.model_extra or {}]

    def as_fields(self) -> SamplingFields:
        values = {name: getattr(self, name) for name in type(self).model_fields}
        renamed = {"max_tokens": values.pop("max_new_tokens"), "min_tokens": values.pop("min_new_tokens")}
        return SamplingFields(**renamed, **values)


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
    logprobs: Optional[CompletionLogprobs] = None


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
    logprobs: Optional[ChatLogprobs] = None


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
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
