"""`Request`'s stop rules with ``min_tokens``: before it, neither a stop token nor a stop string
ends the output; a stop string counts once it ends in the text of the min_tokens-th token or a
later one (also when an earlier occurrence lies before that), and the text released never has to
be taken back. Stop token ids are looked up in a set, never scanned."""
import pytest
import torch

from arfusion.engine.common.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from arfusion.engine.runtime.logits_processors import RowState, process_logits
from arfusion.engine.scheduling.request import Request
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer

EOS = 257


def run(params: SamplingParams, ids: list[int]) -> tuple[str, str, int]:
    """Feed ``ids`` one at a time as the scheduler does; the text released, the finish reason and
    the tokens taken."""
    tokenizer = build_tiny_tokenizer()
    req = Request([1, 2], params, emit=lambda chunk: None)
    released = ""
    for token in ids:
        req.output_ids.append(token)
        req.check_finished((EOS,), 1000)
        chunk = req.release(tokenizer)
        assert req.text.startswith(released + chunk.text), "released text is never taken back"
        released += chunk.text
        if req.finish_reason is not None:
            break
    return released, req.finish_reason, len(req.output_ids)


def text_ids(text: str) -> list[int]:
    return build_tiny_tokenizer().encode(text, add_special_tokens=False)


@pytest.mark.parametrize("stop, min_tokens, text, expected", [
    (("ab",), 0, "xabyab", ("x", "stop", 3)),
    (("ab",), 2, "abab", ("", "stop", 2)),  # the stop string ends in the 2nd token: it counts
    (("ab",), 3, "ababz", ("ab", "stop", 4)),  # the first "ab" ended before min_tokens
    (("b", "cab"), 3, "abcab", ("ab", "stop", 5)),  # the earliest match that counts cuts
    (("b", "zzz"), 2, "bab", ("ba", "stop", 3)),  # a later match of a short stop string is found
    (("zz",), 2, "abcd", ("abcd", "length", 4)),
])
def test_stop_strings_wait_for_min_tokens(stop, min_tokens, text, expected):
    params = SamplingParams(max_tokens=len(text) - (text == "ababz"), min_tokens=min_tokens, stop=stop)
    assert run(params, text_ids(text)) == expected


@pytest.mark.parametrize("stop_token_ids", [(), (EOS,)])
@pytest.mark.parametrize("min_tokens, taken", [(0, 2), (1, 2), (2, 4)])
def test_a_stop_token_before_min_tokens_does_not_end_the_output(stop_token_ids, min_tokens, taken):
    params = SamplingParams(max_tokens=6, min_tokens=min_tokens, stop_token_ids=stop_token_ids)
    assert run(params, [97, EOS, 98, EOS, 99]) == ("ab"[:taken // 2], "stop", taken)


class NoScan(tuple):
    """Stop token ids that refuse a linear membership test (``x in ids``)."""

    def __contains__(self, item: object) -> bool:
        raise AssertionError("stop_token_ids scanned for a token: O(len) per token, not O(1)")


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_stop_token_ids_are_checked_in_a_set(min_tokens: int):
    """Many stop ids (the most a request may have): each token is checked against a set, also by
    the min_tokens ban (`process_logits`), and the first stop id generated ends the output."""
    ids = NoScan(range(300, 300 + MAX_STOP_TOKEN_IDS - 1)) + NoScan((98,))
    params = SamplingParams(max_tokens=6, min_tokens=min_tokens, stop_token_ids=NoScan(ids))
    logits = torch.randn(1, 2000, generator=torch.Generator().manual_seed(0))
    process_logits(logits, [params], [RowState(generated=0)], (EOS,), None)
    assert bool(torch.isinf(logits[0, 300:300 + MAX_STOP_TOKEN_IDS - 1]).all()) == (min_tokens > 0)
    assert run(params, [97, 98, 99, 98, 99]) == (("a", "stop", 2) if min_tokens < 2 else ("abc", "stop", 4))
