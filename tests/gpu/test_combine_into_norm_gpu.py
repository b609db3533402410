"""The MoE combine formed inside the next add + RMSNorm (`--disable-combine-into-norm` off, the
default) in the engine at TP1, against the same model with the combine kept by the experts.

``tiny-moe`` (a 4-layer Qwen3-MoE, 8 experts, top-2; dummy weights) in fp32, prompts of 24 tokens
and 16 teacher-forced decode steps: 8 prompts, so that prefill and decode take the grouped expert
launches, and 1, whose decode steps take the matrix-vector ones; the norm sums their weighted
rows in slot order (the applied form of layers/moe/kernels/triton_topk_combine.py). In fp32 the
two paths round the same sums at the same places (the residual sum is exact in both) and differ
only in the order of fp32 sums: the norm's sum of squares and its reciprocal square root, and
for the matrix-vector launches the sum over a token's slots, about 1e-7 of a row a layer. Bounds: logits within 1e-4 mean relative error and greedy agreement of at least 0.99
(a near-tie of the random model may flip), and every MoE layer leaves its combine to the norm.
"""
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.static_batch_logits import batch_logits

pytestmark = pytest.mark.gpus(1)

PROMPT_LEN, STEPS = 24, 16
CASES = [("tiny-moe", 8), ("tiny-moe", 1)]  # (model, prompts)


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = (a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)
    return {"agreement": agree, "mean_rel_err": rel.mean().item()}


def _case(name: str, count: int) -> dict:
    """The combine kept, then formed in the norm, teacher-forced on the kept run's greedy stream."""
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import random_prompts
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group

    logits, flags, tokens = {}, {}, None
    for kept in (True, False):
        settings = RunnerSettings(model_path=name, dtype="float32", context_length=PROMPT_LEN + STEPS + 8,
                                  max_running_requests=count, cuda_graph_max_bs=count, kv_slots=2048,
                                  fusion=FusionConfig(enabled=False, backend="flashinfer", max_tokens=1024),
                                  disable_combine_into_norm=kept)
        runner = build_runner(settings, get_tp_group())
        prompts = random_prompts(count, PROMPT_LEN, runner.config.vocab_size, seed=5)
        logits[kept], stream = batch_logits(runner, prompts, STEPS, tokens)
        tokens = tokens or stream
        flags[kept] = [layer.unformed_mlp for layer in runner.model.model.layers]
        runner.destroy()
        del runner
        torch.cuda.empty_cache()
    return {"flags": flags, "formed_vs_kept": _compare(logits[False], logits[True])}


def _logits(rank: int, world_size: int) -> dict:
    return {case: _case(*case) for case in CASES}


@pytest.fixture(scope="module")
def results() -> dict:
    r = run_distributed(_logits, world_size=1, device_kind="cuda", timeout_s=900)[0]
    for case in CASES:
        print(f"\n{case}: {r[case]}")
    return r


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{n}-prompts" for m, n in CASES])
def test_every_moe_layer_leaves_its_combine_to_the_norm(results, case):
    flags = results[case]["flags"]
    assert all(flags[False]) and not any(flags[True]), flags


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{n}-prompts" for m, n in CASES])
def test_the_logits_are_the_kept_combines_to_fp32_reassociation(results, case):
    formed = results[case]["formed_vs_kept"]
    assert formed["mean_rel_err"] <= 1e-4 and formed["agreement"] >= 0.99, results[case]
