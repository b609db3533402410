"""Logits processing (`engine.runtime.logits_processors`) against a plain per-token torch
reference of vLLM's semantics: min_tokens bans, logit_bias, and the repetition (prompt and
output), frequency and presence (output) penalties, over a batch of rows with different
parameters and histories recorded on the "device"; the token history's growth; greedy rows
that process their logits take the argmax of the processed logits."""
import pytest
import torch

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.logits_processors import FIRST_ROWS, RowState, TokenHistory, process_logits
from arfusion.engine.runtime.sampler import StepLogits, sample

VOCAB, EOS = 50, (3, 7)


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row processed token by token, in the documented order."""
    x = logits.clone()
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)):
            if 0 <= t < VOCAB:
                x[t] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


ROWS = [
    SamplingParams(temperature=0),  # nothing to process
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.9, presence_penalty=-0.4),
    SamplingParams(frequency_penalty=-1.2, presence_penalty=2.0, logit_bias=((4, -100.0), (9, 35.5))),
    SamplingParams(max_tokens=20, min_tokens=6, stop_token_ids=(11, 10**12)),
    SamplingParams(max_tokens=20, min_tokens=6, ignore_eos=True, stop_token_ids=(12,), repetition_penalty=1.3),
    SamplingParams(max_tokens=20, min_tokens=2, logit_bias=((3, 100.0),)),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("output_len", [0, 2, 9])
def test_processing_equals_the_per_token_reference(seed: int, output_len: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (5 + i,), generator=g).tolist() for i in range(len(ROWS))]
    outputs = [torch.randint(0, VOCAB, (output_len,), generator=g).tolist() for _ in ROWS]
    history = TokenHistory(VOCAB, torch.device("cpu"))
    rows = [history.add(prompt) if p.has_penalties else None for p, prompt in zip(ROWS, prompts)]
    for step in range(output_len):  # the tokens as the scheduler records them, one step at a time
        tracked = [i for i, r in enumerate(rows) if r is not None]
        history.record([rows[i] for i in tracked], torch.tensor([outputs[i][step] for i in tracked]))
    logits = torch.randn(len(ROWS), VOCAB, generator=g) * 3
    processed = logits.clone()
    process_logits(processed, ROWS, [RowState(output_len, r) for r in rows], EOS, history)
    for i, p in enumerate(ROWS):
        torch.testing.assert_close(processed[i], reference(logits[i], p, prompts[i], outputs[i]), rtol=1e-6, atol=1e-6)


def test_the_history_grows_and_keeps_its_rows():
    history = TokenHistory(VOCAB, torch.device("cpu"))
    rows = [history.add([i]) for i in range(FIRST_ROWS + 3)]
    history.record(rows, torch.arange(len(rows)) % VOCAB)
    assert len(set(rows)) == len(rows) and history.counts.shape[0] >= len(rows)
    for i, row in enumerate(rows):
        assert history.prompt[row].nonzero().flatten().tolist() == [i]
        assert history.counts[row].nonzero().flatten().tolist() == [i % VOCAB]
    history.remove(rows[0])
    again = history.add([40])
    assert again == rows[0] and history.counts[again].sum() == 0 and history.prompt[again].nonzero().tolist() == [[40]]


def test_a_penalised_row_without_history_is_refused():
    with pytest.raises(ValueError, match="TokenHistory"):
        process_logits(torch.randn(1, VOCAB), [SamplingParams(presence_penalty=1.0)], [RowState()], EOS, None)


def test_processed_greedy_rows_take_the_processed_argmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, VOCAB, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias=((17, 100.0),)),
              SamplingParams(temperature=0.5, logit_bias=((23, 100.0),), seed=1)]
    processed = logits.clone()
    process_logits(processed, params, [RowState()] * 3, EOS, None)
    step = StepLogits(logits.argmax(-1), logits)
    tokens = sample(step, params, [None, None, torch.Generator().manual_seed(1)], processed)
    assert tokens.tolist() == [logits[0].argmax().item(), 17, 23]
    with pytest.raises(ValueError, match="no processed logits"):
        sample(step, params, [None, None, torch.Generator().manual_seed(1)])
