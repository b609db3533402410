"""Encoding distinct texts keeps no memory per text: the tiny tokenizer's BPE model has no word
cache (its pre-tokenizer leaves a text whole, so the cache would keep every distinct short
prompt, a few KiB each), and the text-only copy `encode_as_text` uses shares that model.

The memory is the C allocator's bytes in use (glibc's ``mallinfo2``; the tokenizer allocates
outside Python, where tracemalloc does not look). Bound: 1 MiB for 2,000 texts of about 200
characters (a cache holds about 4 KiB each: some 8 MiB)."""
import ctypes
import ctypes.util
import random

import pytest

from arfusion.engine.tokenizers.serving import load_serving_tokenizer

pytestmark = pytest.mark.timeout(120)
TEXTS = 2000
BOUND_MIB = 1.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _allocated_mib() -> float:
    """Bytes the C allocator has handed out and not taken back (heap and mmap), in MiB."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "héllo", "world", "\u4e2d\u6587"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(25, 40))) for _ in range(n)]


@pytest.mark.parametrize("model", ["tiny", "llama3-8b"])  # llama3-8b: the tiny tokenizer with added tokens
@pytest.mark.parametrize("method", ["encode", "encode_as_text"])
def test_distinct_texts_leave_no_memory(model: str, method: str):
    tokenizer = load_serving_tokenizer(model)
    encode = getattr(tokenizer, method)
    for text in _texts(50, seed=1):  # first use: the text-only copy, the allocator's pools
        encode(text)
    before = _allocated_mib()
    for text in _texts(TEXTS, seed=2):
        encode(text)
    grown = _allocated_mib() - before
    assert grown < BOUND_MIB, f"{TEXTS} distinct texts through {method} kept {grown:.1f} MiB"
