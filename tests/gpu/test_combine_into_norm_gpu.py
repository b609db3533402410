"""The MoE combine formed inside the next add + RMSNorm (`--disable-combine-into-norm` off, the
default) in the engine at TP1, against the same model with the combine kept by the experts.

``tiny-moe`` (a 4-layer Qwen3-MoE, 8 experts, top-2; dummy weights) in fp32, 8 prompts of 24
tokens and 16 teacher-forced decode steps, so that prefill and decode take the grouped expert
launches, whose weighted rows the norm now sums in slot order (the applied form of
layers/moe/kernels/triton_topk_combine.py). In fp32 the two paths round the same sums at the same
places: the combine's fp32 sum (the same order), the residual sum (exact in both), and differ
only in the order of the norm's sum of squares and its reciprocal square root, about 1e-7 of a
row a layer. Bounds: logits within 1e-4 mean relative error and greedy agreement of at least 0.99
(a near-tie of the random model may flip), and every MoE layer leaves its combine to the norm.
"""
import pytest
import torch

from tests.dist_utils import run_distributed
from tests.static_batch_logits import batch_logits

pytestmark = pytest.mark.gpus(1)

PROMPTS, PROMPT_LEN, STEPS = 8, 24, 16
MODELS = ("tiny-moe",)


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = (a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)
    return {"agreement": agree, "mean_rel_err": rel.mean().item()}


def _logits(rank: int, world_size: int) -> dict:
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import random_prompts
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group

    off = FusionConfig(enabled=False, backend="flashinfer", max_tokens=1024)
    out = {}
    for name in MODELS:
        logits, flags = {}, {}
        tokens = None
        for kept in (True, False):
            settings = RunnerSettings(model_path=name, dtype="float32", context_length=PROMPT_LEN + STEPS + 8,
                                      max_running_requests=PROMPTS, cuda_graph_max_bs=PROMPTS, fusion=off,
                                      kv_slots=2048, disable_combine_into_norm=kept)
            runner = build_runner(settings, get_tp_group())
            prompts = random_prompts(PROMPTS, PROMPT_LEN, runner.config.vocab_size, seed=5)
            if tokens is None:
                logits["kept"], tokens = batch_logits(runner, prompts, STEPS)
            else:
                logits["formed_in_norm"] = batch_logits(runner, prompts, STEPS, tokens)[0]
            flags[kept] = [layer.unformed_mlp for layer in runner.model.model.layers]
            runner.destroy()
            del runner
            torch.cuda.empty_cache()
        out[name] = {"flags": flags, "formed_vs_kept": _compare(logits["formed_in_norm"], logits["kept"])}
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    r = run_distributed(_logits, world_size=1, device_kind="cuda", timeout_s=900)[0]
    for name in MODELS:
        print(f"\n{name}: {r[name]}")
    return r


@pytest.mark.parametrize("name", MODELS)
def test_every_moe_layer_leaves_its_combine_to_the_norm(results, name):
    flags = results[name]["flags"]
    assert all(flags[False]) and not any(flags[True]), flags


@pytest.mark.parametrize("name", MODELS)
def test_the_logits_are_the_kept_combines_to_fp32_reassociation(results, name):
    formed = results[name]["formed_vs_kept"]
    assert formed["mean_rel_err"] <= 1e-4 and formed["agreement"] >= 0.99, results[name]
