"""Sampling: greedy, temperature, top-k, top-p, seeded reproducibility, batch independence."""
import pytest
import torch

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.logits_processors import RowState, process_logits
from arfusion.engine.runtime.sampler import StepLogits, filtered_sorted_probs, sample

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


@pytest.mark.parametrize("top_k", [-1, 3])
@pytest.mark.parametrize("top_p", [1e-50, 7e-46, 5e-324, 1.4e-45, 1e-30, 1e-6])
def test_a_top_p_too_small_for_fp32_decodes_greedily(top_p: float, top_k: int):
    """Below fp32's smallest subnormal (about 1.4e-45) top_p rounds to 0; it then means its limit,
    the most likely token alone (it once kept none and picked the least likely token)."""
    logits = torch.randn(4, 64, generator=gen(11)).repeat(25, 1) * 3
    params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, seed=s) for s in range(100)]
    tokens = sample(step(logits), params, [gen(s) for s in range(100)])
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e38, torch.finfo(torch.float32).max, 3.5e38, 1e39, 1.7e308])
def test_a_temperature_beyond_fp32_is_uniform_over_the_allowed_tokens(temperature: float):
    """Temperatures at and beyond fp32's largest value (3.4e38; 1e38 just below it) with a
    min_tokens ban: every allowed token equally likely (within 0.03 over 6000 draws), a banned one
    never (a temperature of inf once made the ban's -inf / inf a NaN and gave one token always)."""
    eos, stop_id, vocab = 7, 3, 8
    logits = torch.randn(1, vocab, generator=gen(12)) * 5
    params = SamplingParams(temperature=temperature, min_tokens=2, max_tokens=4, stop_token_ids=(stop_id,))
    processed = logits.clone()
    process_logits(processed, [params], [RowState(generated=0)], (eos,), None)
    draws = 6000
    tokens = sample(step(logits.repeat(draws, 1)), [params] * draws, [gen(13 + i) for i in range(draws)],
                    processed.repeat(draws, 1))
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[eos] == 0 and counts[stop_id] == 0
    allowed = [t for t in range(vocab) if t not in (eos, stop_id)]
    torch.testing.assert_close(counts[allowed] / counts.sum(), torch.full((len(allowed),), 1 / len(allowed), dtype=torch.float64),
                               atol=0.03, rtol=0)
