"""`engine.greedy.greedy_tokens` on the GPU: equal to ``torch.argmax`` on llama3 and qwen2
vocabularies, and its time per call (host launch included: the decode step waits on it) next
to ``torch.argmax`` (printed, not asserted)."""
import time

import pytest
import torch

from engine.greedy import greedy_tokens


@pytest.mark.parametrize("vocab", [128256, 151936])
@pytest.mark.parametrize("batch", [1, 32, 128])
def test_greedy_tokens_match_argmax_on_cuda(vocab, batch):
    logits = torch.randn(batch, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))


def _us_per_call(fn, logits, calls=300) -> float:
    """Wall µs per call including the .tolist() sync, as a decode step pays it."""
    for _ in range(20):
        fn(logits).tolist()
    start = time.perf_counter()
    for _ in range(calls):
        fn(logits).tolist()
    return (time.perf_counter() - start) * 1e6 / calls


def test_print_greedy_timing():
    rows = []
    for batch in (1, 32, 128):
        logits = torch.randn(batch, 128256, device="cuda")
        ours, torch_us = _us_per_call(greedy_tokens, logits), _us_per_call(lambda x: torch.argmax(x, dim=-1), logits)
        rows.append(f"greedy batch {batch:>3}: two-stage {ours:6.1f} us, torch.argmax {torch_us:6.1f} us (with .tolist())")
    print("\n" + "\n".join(rows))
