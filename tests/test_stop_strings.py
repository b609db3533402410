"""Stop strings: bounded in count and length (400 naming ``stop``), found by one automaton
(`StopStrings`) in time independent of the list: a request never scans its stop list per token.
The automaton agrees with a brute-force search (the first stop string to end in the text, the
longest of those ending there; text that may still grow into one held back) however the text is
cut into tokens."""
import random
import time

import pytest
from fastapi.testclient import TestClient

from arfusion.engine.common.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from arfusion.engine.common.stop_strings import StopStrings
from arfusion.engine.scheduling.request import Request
from arfusion.engine.server.api import build_app
from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(120)


def brute_cut(stops: list[str], text: str, floor: int) -> tuple[int | None, int]:
    """(start of the first stop string to end in ``text`` past ``floor``, the longest of those
    ending there; None for none), and the longest tail of ``text`` that is a prefix of a stop."""
    for end in range(floor + 1, len(text) + 1):
        ending = [s for s in stops if text.endswith(s, 0, end)]
        if ending:
            return end - max(map(len, ending)), 0
    held = max((k for s in stops for k in range(1, len(s) + 1) if text.endswith(s[:k])), default=0)
    return None, held


@pytest.mark.parametrize("longest", [6, 40])  # 40: deep states, long failure chains (few letters)
@pytest.mark.parametrize("seed", range(40))
def test_the_automaton_agrees_with_a_brute_force_search(seed: int, longest: int):
    rng = random.Random(seed * 100 + longest)
    alphabet = "abc" if seed % 2 else "ab"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, longest))) for _ in range(rng.randint(1, 8))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10 * longest)))
    floor = rng.randint(0, len(text))
    automaton, state, fed, cut = StopStrings(stops), 0, 0, None
    while fed < len(text) and cut is None:  # the text arrives in random pieces
        piece = text[:fed + rng.randint(1, 4)]
        state, cut = automaton.scan(state, piece, fed, floor)
        fed = len(piece)
        if cut is None:
            assert automaton.depth(state) == brute_cut(stops, piece, len(piece))[1]
    expected = brute_cut(stops, text, floor)[0]
    assert cut == expected


def test_building_the_automaton_does_not_grow_with_the_list():
    """The automaton is built lazily: making it for the largest list allowed (64 x 1024
    characters) takes about as long as for 64 one-character strings (a sort), not the ~100 ms an
    eager build takes, during which it held the GIL of every thread of the server (a flood of
    short requests with such lists slowed other clients' streams to a third)."""
    rng = random.Random(3)
    largest = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(MAX_STOP_STRING_CHARS))
               for _ in range(MAX_STOP_STRINGS)]
    smallest = [chr(ord("!") + i) for i in range(MAX_STOP_STRINGS)]

    def build_s(stops: list[str]) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            StopStrings(stops)
            times.append(time.perf_counter() - start)
        return min(times)

    assert build_s(largest) < 20 * build_s(smallest) + 1e-3


class ArmedStops(tuple):
    """Stop strings that refuse to be iterated once ``armed``: a per-token scan of the list fails."""

    armed = False

    def __iter__(self):
        if ArmedStops.armed:
            raise AssertionError("the stop list was scanned for a token: O(stops) per token")
        return super().__iter__()


@pytest.fixture
def armed():
    yield ArmedStops
    ArmedStops.armed = False


@pytest.mark.parametrize("min_tokens", [0, 6])  # 6: the first "cd" ends before the 6th token
def test_a_request_never_scans_its_stop_list_per_token(armed, min_tokens: int):
    rng = random.Random(min_tokens)
    stops = ArmedStops(["".join(rng.choice("xyz") for _ in range(MAX_STOP_STRING_CHARS))
                        for _ in range(MAX_STOP_STRINGS - 1)] + ["cd"])
    params = SamplingParams(max_tokens=20, min_tokens=min_tokens, stop=stops)
    assert params.stop_strings is params.stop_strings  # made (a sort of the list) before the request runs
    armed.armed = True
    tokenizer = build_tiny_tokenizer()
    req = Request([1, 2], params, emit=lambda chunk: None)
    released = ""
    for token in tokenizer.encode("abxcdcd", add_special_tokens=False):
        req.output_ids.append(token)
        req.check_finished((257,), 1000)
        released += req.release(tokenizer).text
        if req.finish_reason:
            break
    assert (released, req.finish_reason) == (("abx", "stop") if min_tokens == 0 else ("abxcd", "stop"))


def test_text_that_cannot_begin_a_stop_string_is_released_at_once():
    tokenizer = build_tiny_tokenizer()
    req = Request([1, 2], SamplingParams(max_tokens=20, stop=("x" * MAX_STOP_STRING_CHARS, "abc")), emit=lambda c: None)
    texts = []
    for token in tokenizer.encode("qrxxab", add_special_tokens=False):
        req.output_ids.append(token)
        texts.append(req.release(tokenizer).text)
    assert texts == ["q", "r", "", "", "xx", ""]  # "x", "xx" may begin the long one, "a", "ab" the short one
    req.output_ids.append(tokenizer.encode("z", add_special_tokens=False)[0])
    assert req.release(tokenizer).text == "abz"


@pytest.mark.parametrize("stop, field_error", [
    (["s"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
    (["ok", "y" * (MAX_STOP_STRING_CHARS + 1)], f"1 to {MAX_STOP_STRING_CHARS} characters"),
    (["x" * 500_000], f"1 to {MAX_STOP_STRING_CHARS} characters"),
    ([f"s{i}" for i in range(40_000)], f"at most {MAX_STOP_STRINGS} stop strings"),
])
@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_too_many_or_too_long_stop_strings_are_refused_naming_the_field(stop, field_error: str, url: str):
    client = TestClient(build_app(FakeEngine(context_length=64), "served"))
    body = {"stop": stop, "max_tokens": 4}
    body = ({"text": "hi", "sampling_params": {"stop": stop, "max_new_tokens": 4}} if url == "/generate"
            else {"prompt": "hi", **body} if url == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}], **body})
    resp = client.post(url, json=body)
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert message.startswith("stop:") and field_error in message


def test_the_largest_allowed_stop_lists_are_served():
    fake = FakeEngine(context_length=64)
    client = TestClient(build_app(fake, "served"))
    stop = ["z" * MAX_STOP_STRING_CHARS] * (MAX_STOP_STRINGS - 1) + ["ih"]
    resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stop": stop})
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "stop"
    assert len(fake.requests[0][1].stop) == MAX_STOP_STRINGS
