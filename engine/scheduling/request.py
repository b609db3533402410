"""`Request`: one generation on TP rank 0: its tokens, KV slots, how much of its prompt has been
prefilled (a long prompt may be prefilled in chunks over several steps), the output text
(decoded after the prompt's, `engine.scheduling.detokenizer`) that has been released so far
(stop strings cut, a possible stop-string prefix held back), and the
log-probabilities it asked for. Before ``min_tokens`` output tokens no stop token or stop string
ends it: only a stop string that ends in the text of a later token counts. Requests compare by
identity."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from arfusion.engine.common.generation import EngineError, GenerationChunk, TokenizerLike, TokenLogprob
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.scheduling.detokenizer import IncrementalDetokenizer

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Union[GenerationChunk, EngineError]], None]  # thread-safe delivery to the waiting client
    rid: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # KV slots of all tokens so far
    row: Optional[int] = None  # request-to-token table row while running
    prefilled: int = 0  # prompt tokens launched in prefill steps (their K/V written by then)
    generator: Optional[torch.Generator] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", or "error" (it got an EngineError)
    tokens_in_flight: int = 0  # tokens sampled on the device by launched steps, not yet in output_ids
    text: str = ""  # output decoded so far (complete characters)
    released_text: str = ""  # the part of ``text`` already sent to the client
    released_ids: int = 0  # output ids already sent
    history_row: Optional[int] = None  # its `TokenHistory` row while running (requests with a penalty)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output id (if asked for)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens scored so far
    _detokenizer: Optional[IncrementalDetokenizer] = None  # made by the first `release`
    _stop_floor: int = 0  # a stop string must end past this much text (the text before min_tokens)
    _stop_state: int = 0  # the stop-string automaton's state after ``text[:_stop_scanned]``
    _stop_scanned: int = 0

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def launched_len(self) -> int:
        """``seq_len`` once the launched steps' tokens arrive: the input token of the next decode
        step is at position ``launched_len - 1``."""
        return self.seq_len + self.tokens_in_flight

    @property
    def prefill_done(self) -> bool:
        """Its whole prompt has been launched: the step of its last prompt token samples its first
        output token."""
        return self.prefilled == len(self.prompt_ids)

    @property
    def wants_decode_step(self) -> bool:
        """Still running, prefilled, and not every one of its ``max_tokens`` has been launched."""
        return (self.finish_reason is None and self.prefill_done
                and len(self.output_ids) + self.tokens_in_flight < self.params.max_tokens)

    @property
    def reserved_tokens(self) -> int:
        """KV slots this request may need in all: prompt plus every output token but the last
        (whose K/V is never computed); the prompt alone for ``max_tokens`` 0."""
        return len(self.prompt_ids) + max(self.params.max_tokens, 1) - 1

    @property
    def sampled(self) -> int:
        """Output tokens sampled so far, those on their way to the host included."""
        return len(self.output_ids) + self.tokens_in_flight

    def check_finished(self, eos_ids: tuple[int, ...], context_len: int) -> None:
        """Set ``finish_reason`` after a new token: stop token ("stop", from ``min_tokens`` on),
        max_tokens or a full context ("length"). Stop strings are found in `release`."""
        last = self.output_ids[-1]
        stops = last in self.params.stop_token_set or (not self.params.ignore_eos and last in eos_ids)
        if stops and len(self.output_ids) > self.params.min_tokens:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens or self.seq_len >= context_len:
            self.finish_reason = "length"

    def _visible_ids(self, eos_ids: tuple[int, ...]) -> list[int]:
        ids = self.output_ids
        if self.finish_reason == "stop" and ids and (ids[-1] in self.params.stop_token_set or ids[-1] in eos_ids):
            return ids[:-1]
        return ids

    def _find_stop(self) -> Optional[int]:
        """Where the text is cut for a stop string: the start of the first one to end in the text
        not yet scanned, past ``_stop_floor`` (the longest of those ending at the same place);
        None for none. Scans only the new text, with the request's one `StopStrings` automaton."""
        if not self.params.stop:
            return None
        self._stop_state, cut = self.params.stop_strings.scan(self._stop_state, self.text, self._stop_scanned,
                                                              self._stop_floor)
        self._stop_scanned = len(self.text)
        return cut

    def release(self, tokenizer: TokenizerLike) -> GenerationChunk:
        """The chunk of new output to send now. A trailing stop token is not shown; the text
        ends before the first stop string to end in it; text that could still grow into a stop
        string (the automaton state's depth) is held back until it cannot."""
        if self._detokenizer is None:
            self._detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_ids)
        self.text += self._detokenizer.new_text(tokenizer, self._visible_ids(tokenizer.eos_token_ids),
                                                self.finish_reason is not None)
        if len(self.output_ids) < self.params.min_tokens:
            self._stop_floor = len(self.text)
        cut = self._find_stop()
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
            releasable = self.text
        elif self.finish_reason is None:
            held = self.params.stop_strings.depth(self._stop_state) if self.params.stop else 0
            releasable = self.text[: max(len(self.released_text), len(self.text) - held)]
        else:
            releasable = self.text
        delta = releasable[len(self.released_text):]
        first = self.released_ids == 0
        new_ids = self.output_ids[self.released_ids:]
        logprobs = self.output_logprobs[self.released_ids:] if self.params.logprobs is not None else None
        self.released_text = releasable
        self.released_ids = len(self.output_ids)
        return GenerationChunk(
            text=delta,
            token_ids=new_ids,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            finish_reason=self.finish_reason,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if first and self.params.prompt_logprobs is not None else None,
        )
