"""`engine.greedy.greedy_tokens` equals ``torch.argmax`` on random logits, ties and odd vocabs."""
import pytest
import torch

from engine.greedy import chunk_count, greedy_tokens


@pytest.mark.parametrize("vocab", [128256, 151936, 32000, 1000, 997, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_argmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))


def test_ties_resolve_to_the_lowest_index_like_argmax():
    vocab = 1024
    logits = torch.zeros(4, vocab)
    logits[0, [5, 900]] = 3.0  # across chunks
    logits[1, [10, 11]] = 2.0  # within a chunk
    logits[2] = 1.0  # every entry ties
    logits[3, [vocab - 1]] = 1.0
    assert greedy_tokens(logits).tolist() == [5, 10, 0, vocab - 1] == torch.argmax(logits, -1).tolist()


def test_chunk_count_divides_the_vocab():
    assert chunk_count(128256) == 256 and chunk_count(997) == 1 and 151936 % chunk_count(151936) == 0


def test_rejects_a_flat_tensor():
    with pytest.raises(ValueError, match="batch, vocab"):
        greedy_tokens(torch.randn(10))
