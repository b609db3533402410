"""benchmarks.teacher_forced_agreement on the CPU: the sequences it builds, its statistics, and a
whole run at TP2 over gloo on a tiny Qwen2-style GGUF (tests/gguf_files.py) with the torch
fusion backend, whose fp32 math equals the unfused path's: agreement 100 % and zero logits error.
The GPU test (tests/gpu/test_teacher_forced_agreement.py) runs the same code on the real model."""
from pathlib import Path

import pytest
import torch

from arfusion.benchmarks.gsm8k import scoring
from arfusion.benchmarks.gsm8k.bench import load_jsonl
from arfusion.benchmarks.teacher_forced_agreement import (
    AgreementOptions, AgreementStats, build_sequences, format_result, measure, prefill_groups, teacher_forced_logits,
)
from arfusion.engine.tokenizers.serving import load_serving_tokenizer
from tests.dist_utils import run_distributed
from tests.gguf_files import qwen2_chat_file

GSM8K = Path(__file__).parent / "fixtures" / "gsm8k"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(qwen2_chat_file(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf")[0])


def test_sequences_are_the_eval_prompt_then_the_reference_solution(model_path):
    tokenizer = load_serving_tokenizer(model_path)
    questions, shots = load_jsonl(GSM8K / "test.jsonl"), load_jsonl(GSM8K / "train.jsonl")[:2]
    sequences = build_sequences(tokenizer, questions, shots, min_positions=60)
    assert sum(len(s.solution) for s in sequences[:-1]) < 60 <= sum(len(s.solution) for s in sequences)
    first = sequences[0]
    assert first.prompt == tokenizer.encode(scoring.build_prompt(shots, questions[0]["question"]))
    solved = [scoring.format_shot(q["question"], q["answer"]) for q in [*shots, questions[0]]]
    assert tokenizer.decode(first.prompt + first.solution) == "".join(solved)
    assert tokenizer.decode(first.solution).startswith(" The trays hold 3 * 12 = 36 muffins.")
    with pytest.raises(ValueError, match="fewer than 100000"):
        build_sequences(tokenizer, questions, shots, min_positions=100000)


@pytest.mark.parametrize("lengths, groups", [
    ([3, 4, 2, 6], [[0, 1, 2], [3]]),
    ([12, 1, 9], [[0], [1, 2]]),  # a prompt over the limit takes a step alone
    ([5], [[0]]),
])
def test_prefill_groups_pack_prompts_up_to_the_limit(lengths, groups):
    assert prefill_groups(lengths, max_tokens=10) == groups


def test_stats_count_agreement_errors_and_margins():
    off = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 2.9], [1.0, 1.0, 5.0]])
    on = off.clone()
    on[1, 2] = 3.1  # flips row 1's argmax from 0 to 2: a near-tie in the unfused logits (margin 0.1)
    stats = AgreementStats()
    stats.add(off, on, torch.tensor([1, 2, 0]), rows=[0, 1], where=[(7, 0), (8, 3)])  # row 2 not counted
    got = stats.summary()
    assert (got["positions"], got["agreeing"], got["num_disagreements"]) == (2, 1, 1)
    assert got["reference_accuracy"] == {"off": 0.5, "on": 1.0}
    assert got["max_abs_logit_err"] == pytest.approx(0.2) and got["mean_abs_logit_err"] == pytest.approx(0.2 / 6)
    assert got["disagreements"] == [{"question": 8, "position": 3, "off_token": 0, "on_token": 2,
                                     "off_margin": pytest.approx(0.1)}]


def _aligned(rank: int, world: int, model_path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: its teacher-forced logits, and the logits of one forward over prompt +
    solution at the positions that predict the solution tokens."""
    from arfusion.engine.models.forward_batch import ForwardBatch
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.layers.parallel_state import get_tp_group

    tokenizer = load_serving_tokenizer(model_path)
    batch = build_sequences(tokenizer, load_jsonl(GSM8K / "test.jsonl"), load_jsonl(GSM8K / "train.jsonl")[:1], 200)
    runner = build_runner(RunnerSettings(model_path=model_path, max_running_requests=len(batch), kv_slots=4096), get_tp_group())
    steps = [logits.clone() for logits in teacher_forced_logits(runner, batch, max_prefill_tokens=300)]
    out = []
    for i, s in enumerate(batch):
        tokens = s.prompt + s.solution
        with torch.inference_mode():
            hidden = runner.model.model(ForwardBatch.from_lists([tokens], [list(range(1, len(tokens) + 1))]), runner.kv_cache)
            whole = runner.model.lm_head(hidden).gather()
        out.append((torch.stack([steps[j][i] for j in range(len(s.solution))]), whole[len(s.prompt) - 1:len(tokens) - 1]))
    runner.destroy()
    return out


def test_teacher_forced_logits_are_those_of_the_whole_sequence(model_path):
    """Step s of the prefill-then-decode driver predicts solution token s: the same logits as one
    forward over prompt + solution (fp32, TP1), at every position."""
    for forced, whole in run_distributed(_aligned, world_size=1, args=(model_path,), timeout_s=120)[0]:
        torch.testing.assert_close(forced, whole, rtol=1e-4, atol=1e-4)


def _measure(rank: int, world: int, model_path: str) -> dict:
    from arfusion.server_args import ServerArgs

    server = ServerArgs(model_path=model_path, tp_size=world, device="cpu", allreduce_fusion_backend="torch",
                        max_prefill_tokens=512)  # several prefill steps per batch
    options = AgreementOptions(str(GSM8K / "test.jsonl"), num_shots=1, min_positions=300, batch_size=4)
    return measure(server, options)


@pytest.mark.timeout(300)
def test_torch_backend_agrees_bit_for_bit_at_tp2(model_path):
    ranks = run_distributed(_measure, world_size=2, args=(model_path,), timeout_s=240)
    result = ranks[0]
    print("\n" + format_result(result))
    assert ranks[1]["agreeing"] == result["agreeing"], "every rank sees the same gathered logits"
    assert result["positions"] >= 300 and result["sequences"] > 4, "more than one batch: both setting orders ran"
    assert result["agreement"] == 1.0 and result["num_disagreements"] == 0
    assert result["max_abs_logit_err"] == 0.0 and result["max_rel_err"] == 0.0
    assert result["fused_status"]["active"] and result["fused_status"]["backend"] == "torch"
