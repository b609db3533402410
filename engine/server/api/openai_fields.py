"""What the server does with every documented OpenAI request field of /v1/completions and
/v1/chat/completions (and the vLLM extensions it knows): each one is honoured, inert, or refused.

Honoured fields change the output as OpenAI (or vLLM, for the extensions) documents them.
Inert fields have no effect on a text completion by their definition (``user``, ``metadata``: a
label; ``parallel_tool_calls``: there are no tools; ``prompt_cache_key``: a caching hint) and are
accepted. Every other field is accepted only at the values that ask for nothing this server
lacks (``n`` 1, ``tools`` empty, ``response_format`` text, ...); any other value is refused with a
400 that names the field and why. So is a vLLM extension this server does not implement, set to
anything but its default. Fields neither OpenAI nor vLLM document are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

COMMON_HONOURED = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                   "presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
EXTENSIONS_HONOURED = ("top_k", "min_tokens", "repetition_penalty", "stop_token_ids", "ignore_eos")  # vLLM's
COMPLETION_HONOURED = COMMON_HONOURED + EXTENSIONS_HONOURED + ("prompt", "echo")
CHAT_HONOURED = COMMON_HONOURED + EXTENSIONS_HONOURED + ("messages", "max_completion_tokens", "top_logprobs")
INERT = ("user", "metadata", "safety_identifier", "prompt_cache_key", "parallel_tool_calls")


@dataclass(frozen=True)
class Limited:
    """A field accepted only at values ``accepts`` allows; otherwise refused, with ``why``."""

    accepts: Callable[[Any], bool]
    why: str


def _none(value: Any) -> bool:
    return value is None


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == a and type(value) is type(a) for a in allowed)


def _empty(value: Any) -> bool:
    return not value


NO_TOOLS = "this server does no tool calling"
COMMON_LIMITED: dict[str, Limited] = {"n": Limited(_one_of(1), "only n=1 is supported")}
COMPLETION_LIMITED: dict[str, Limited] = {
    **COMMON_LIMITED,
    "best_of": Limited(_one_of(1), "only best_of=1 is supported"),
    "suffix": Limited(_one_of(""), "no insertion: a suffix cannot be honoured"),
}
CHAT_LIMITED: dict[str, Limited] = {
    **COMMON_LIMITED,
    "tools": Limited(_empty, NO_TOOLS),
    "tool_choice": Limited(_one_of("none"), NO_TOOLS),
    "functions": Limited(_empty, NO_TOOLS),
    "function_call": Limited(_one_of("none"), NO_TOOLS),
    "response_format": Limited(_one_of({"type": "text"}), 'only {"type": "text"}: no JSON mode or schema'),
    "audio": Limited(_none, "text output only"),
    "modalities": Limited(_one_of(["text"]), "text output only"),
    "prediction": Limited(_none, "no predicted outputs"),
    "reasoning_effort": Limited(_none, "not a reasoning model"),
    "verbosity": Limited(_none, "no verbosity control"),
    "web_search_options": Limited(_none, "no web search"),
    "service_tier": Limited(_one_of("auto", "default"), "one service tier"),
    "store": Limited(_one_of(False), "completions are not stored"),
}
# vLLM's sampling extensions that this server does not implement, accepted at their defaults only
EXTENSIONS_LIMITED: dict[str, Limited] = {
    "min_p": Limited(_one_of(0, 0.0), "not implemented"),
    "use_beam_search": Limited(_one_of(False), "no beam search"),
    "length_penalty": Limited(_one_of(1, 1.0), "no beam search"),
    "include_stop_str_in_output": Limited(_one_of(False), "not implemented"),
    "skip_special_tokens": Limited(_one_of(True), "special tokens are always skipped"),
    "spaces_between_special_tokens": Limited(_one_of(True), "not implemented"),
    "truncate_prompt_tokens": Limited(_none, "prompts are never truncated"),
    "prompt_logprobs": Limited(_none, "use echo with logprobs"),
    "allowed_token_ids": Limited(_none, "not implemented"),
    "bad_words": Limited(_empty, "not implemented"),
    "guided_json": Limited(_none, "no guided decoding"),
    "guided_regex": Limited(_none, "no guided decoding"),
    "guided_choice": Limited(_none, "no guided decoding"),
    "guided_grammar": Limited(_none, "no guided decoding"),
    "structured_outputs": Limited(_none, "no guided decoding"),
    "return_tokens_as_token_ids": Limited(_one_of(False), "not implemented"),
}


def refused(values: Mapping[str, Any], limited: Mapping[str, Limited]) -> list[str]:
    """``"field (why)"`` for each field of ``values`` set to a value ``limited`` does not accept."""
    return [f"{name} ({rule.why})" for name, rule in limited.items()
            if name in values and not rule.accepts(values[name])]
