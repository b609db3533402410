"""`Tokenizer.encode` lets other threads run while it encodes (the server tokenizes in a worker
thread: an encode that held the GIL would stop the event loop all the same), and gives the ids
the tokenizer's own ``encode`` gives."""
import random
import threading
import time

import pytest

from arfusion.engine.tokenizers.serving import load_serving_tokenizer

pytestmark = pytest.mark.timeout(120)


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    pieces = ["<|im_start|>", "<|t300|>", "é", "\u4e2d\u6587", "\n"]
    return " ".join(rng.choice(pieces) if rng.random() < 0.05 else "".join(rng.choices("abcdefghij", k=rng.randint(1, 9)))
                    for _ in range(words))


@pytest.mark.parametrize("model", ["tiny", "llama3-8b"])  # llama3-8b: the tiny tokenizer with added tokens
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_ids_are_the_tokenizers_own(model: str, add_special_tokens: bool):
    tokenizer = load_serving_tokenizer(model)
    text = _text(3000, seed=len(model))
    expected = tokenizer.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


def test_a_long_encode_lets_other_threads_run():
    """While a thread encodes a text long enough to take a while, this thread sleeps 5 ms at a
    time: its longest wait must be a small part of the encode (holding the GIL, it is all of it)."""
    tokenizer = load_serving_tokenizer("llama3-8b")
    text = _text(500_000, seed=0)
    done = threading.Event()

    def encode() -> None:
        tokenizer.encode(text)
        done.set()

    worker = threading.Thread(target=encode)
    start = time.monotonic()
    worker.start()
    longest, last = 0.0, start
    while not done.is_set():
        time.sleep(0.005)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    took = time.monotonic() - start
    worker.join()
    print(f"\nencoding {len(text)} characters took {took:.2f} s; this thread waited {longest * 1e3:.0f} ms at most")
    assert took > 0.2, "the text encodes too fast to show anything: make it longer"
    assert longest < took / 4
