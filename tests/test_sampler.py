"""Sampling: greedy, temperature, top-k, top-p, seeded reproducibility, batch independence."""
import pytest
import torch

from engine.common.sampling_params import SamplingParams
from engine.runtime.sampler import StepLogits, filtered_sorted_probs, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])


def gen(seed):
    return torch.Generator().manual_seed(seed)


def step(logits: torch.Tensor) -> StepLogits:
    """A step that gathered its logits (greedy tokens: their argmax)."""
    return StepLogits(logits.argmax(-1), logits)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 50, generator=gen(0))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1)] * 2
    assert sample(step(logits), params, [None] * 4).tolist() == logits.argmax(-1).tolist()


def test_top_k_and_top_p_filter_the_sorted_distribution():
    probs, order = filtered_sorted_probs(LOGITS, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert order[0, :2].tolist() == [0, 1] and (probs[0, 2:] == 0).all() and (probs[0, :2] > 0).all()
    full = torch.softmax(LOGITS, -1)[0].sort(descending=True).values
    probs, _ = filtered_sorted_probs(LOGITS, torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([full[0].item() + 1e-3]))
    assert (probs[0, 2:] == 0).all() and probs[0, 1] > 0, "the token that crosses top_p is kept"


def test_sampling_matches_the_softmax_distribution():
    params = [SamplingParams(temperature=0.7)]
    g = gen(3)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(step(LOGITS), params, [g])[0].item()] += 1
    expected = torch.softmax(LOGITS / 0.7, -1)[0]
    torch.testing.assert_close(counts / counts.sum(), expected, atol=0.03, rtol=0)


def test_filtered_tokens_are_never_sampled():
    params = [SamplingParams(temperature=1.0, top_k=2)]
    g = gen(4)
    assert {sample(step(LOGITS), params, [g])[0].item() for _ in range(300)} <= {0, 1}


def test_seeded_request_is_independent_of_the_batch():
    logits = torch.randn(3, 100, generator=gen(5))
    alone = [sample(step(logits[1:2]), [SamplingParams(temperature=1.0, seed=7)], [gen(7)])[0].item() for _ in range(1)]
    batched = sample(step(logits), [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=7),
                              SamplingParams(temperature=0.5)], [None, gen(7), gen(8)])
    assert batched[1].item() == alone[0]
    assert torch.equal(sample(step(logits), [SamplingParams(temperature=1.0)] * 3, [gen(1), gen(2), gen(3)]),
                       sample(step(logits), [SamplingParams(temperature=1.0)] * 3, [gen(1), gen(2), gen(3)]))


def test_greedy_tokens_come_from_the_step_and_stay_untouched():
    greedy = torch.tensor([3, 1])
    assert sample(StepLogits(greedy), [SamplingParams(temperature=0)] * 2, [None, None]) is greedy
    logits = torch.randn(2, 5, generator=gen(2))
    out = sample(StepLogits(greedy, logits), [SamplingParams(temperature=0), SamplingParams(temperature=1.0)],
                 [None, gen(3)])
    assert out[0].item() == 3 and greedy.tolist() == [3, 1], "sampled rows go into a copy: graph outputs are reused"


def test_sampling_without_gathered_logits_is_refused():
    with pytest.raises(ValueError, match="did not gather its logits"):
        sample(StepLogits(torch.tensor([0, 0])), [SamplingParams(temperature=0), SamplingParams(temperature=0.7)],
               [None, gen(1)])


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("temperature", float("inf")),
                                          ("top_p", float("nan")), ("top_k", 2**63), ("seed", 2**64),
                                          ("max_tokens", 2**63), ("stop_token_ids", (2**63,))])
def test_params_the_sampler_cannot_hold_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_temperatures_too_small_to_divide_by_decode_greedily():
    """logits / 1e-30 overflows fp32 (softmax of inf is NaN): such rows take the argmax."""
    logits = torch.randn(2, 50, generator=gen(6)) * 10
    params = [SamplingParams(temperature=1e-30), SamplingParams(temperature=1e-5)]
    assert all(p.greedy for p in params)
    assert sample(step(logits), params, [gen(1), gen(2)]).tolist() == logits.argmax(-1).tolist()
