"""Teacher-forced greedy agreement of fused (flashinfer backend, the server's default table) vs
unfused all-reduce on a real checkpoint at TP2, bf16: GSM8K prompts plus their reference
solutions, at least 20,000 compared positions (benchmarks/teacher_forced_agreement.py).

    ARFUSION_MODEL_PATH=/tmp/model.gguf python -m pytest tests/gpu/test_teacher_forced_agreement.py -s

ARFUSION_MODEL_PATH: the model (skipped without it); ARFUSION_GSM8K_PATH: the GSM8K test file
(default .data/gsm8k/test.jsonl in the repository, train.jsonl next to it; skipped when absent).
Target: agreement >= 99 %; the mean and max logits error are printed.
"""
import json
import os
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("ARFUSION_MODEL_PATH")
GSM8K = Path(os.environ.get("ARFUSION_GSM8K_PATH", REPO / ".data" / "gsm8k" / "test.jsonl"))
MIN_POSITIONS, MIN_AGREEMENT = 20000, 0.99

pytestmark = [
    pytest.mark.tp_ranks(2),  # two ranks, on two GPUs or sharing one
    pytest.mark.skipif(not MODEL, reason="set ARFUSION_MODEL_PATH to a real checkpoint (e.g. the Qwen2.5-Coder GGUF)"),
    pytest.mark.skipif(not GSM8K.is_file(), reason=f"no GSM8K test file at {GSM8K} (ARFUSION_GSM8K_PATH)"),
]


def _measure(rank: int, world: int, model: str, gsm8k: str) -> dict:
    from arfusion.benchmarks.teacher_forced_agreement import AgreementOptions, measure
    from arfusion.server_args import ServerArgs

    server = ServerArgs(model_path=model, tp_size=world, device="cuda", allreduce_fusion_backend="flashinfer")
    return measure(server, AgreementOptions(gsm8k, min_positions=MIN_POSITIONS))


@pytest.mark.timeout(900)
def test_fused_greedy_agrees_with_unfused_on_a_real_model():
    from arfusion.benchmarks.teacher_forced_agreement import format_result

    result = run_distributed(_measure, world_size=2, args=(MODEL, str(GSM8K)), device_kind="cuda", timeout_s=840)[0]
    print("\n" + format_result(result))
    print(json.dumps({k: v for k, v in result.items() if k != "disagreements"}, default=str))
    assert result["fused_status"]["active"], result["fused_status"]
    assert result["positions"] >= MIN_POSITIONS
    assert result["agreement"] >= MIN_AGREEMENT, format_result(result)
