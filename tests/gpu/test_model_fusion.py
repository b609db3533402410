"""llama3-8b shapes, TP2, bf16, dummy weights: fusion on (flashinfer) vs off.

Greedy decode of 8 prompts for 256 steps with fusion off gives the reference tokens; the
fusion-on model is fed the same tokens (teacher forcing) and must pick the same greedy token
at >= 99% of the steps, with logits within 1e-2 relative error. One eager forward counts the
reductions that ran in flashinfer's fused kernel: one per reduction point of every layer.
"""
import pytest
import torch

from tests.dist_utils import run_distributed

PROMPTS, PROMPT_LEN, STEPS = 8, 32, 256


def _run(rank, world_size):
    from dataclasses import replace

    from engine.model_runner import ModelRunner, RunnerSettings
    from engine.static_batch import StaticBatch, random_prompts
    from fusion import FusionConfig
    from layers.parallel_state import get_tp_group

    group = get_tp_group()
    fusion = FusionConfig(enabled=False, backend="flashinfer", max_tokens=2048)
    settings = RunnerSettings(model_path="llama3-8b", dtype="bfloat16", context_length=PROMPT_LEN + STEPS + 8,
                              max_running_requests=PROMPTS, cuda_graph_max_bs=PROMPTS, fusion=fusion, kv_slots=8192)
    runner = ModelRunner(settings, group)
    prompts = random_prompts(PROMPTS, PROMPT_LEN, runner.config.vocab_size, seed=1)
    out = {}

    # Fusion off: free-running greedy reference.
    batch = StaticBatch(runner, prompts, STEPS + 1)
    # forward() returns the decode graph's static output buffer: keep a copy of each step.
    logits_off = [batch.prefill().clone()]
    tokens = [torch.argmax(logits_off[-1], -1).tolist()]
    for _ in range(STEPS):
        logits_off.append(batch.decode(tokens[-1]).clone())
        tokens.append(torch.argmax(logits_off[-1], -1).tolist())

    # Fusion on: same tokens fed in; count the fused reductions of one eager forward.
    runner.reconfigure_fusion(replace(fusion, enabled=True))
    out["status"] = runner.fusion.status()
    batch = StaticBatch(runner, prompts, STEPS + 1)
    group.counters.reset()
    logits_on = [batch.prefill().clone()]
    out["prefill_counters"] = (group.counters.total, group.counters.fused, group.counters.flashinfer)
    agree, rel_errs = 0, []
    for step in range(STEPS):
        logits_on.append(batch.decode(tokens[step]).clone())
    for step in range(STEPS + 1):
        on, off = logits_on[step], logits_off[step]
        agree += int((torch.argmax(on, -1) == torch.argmax(off, -1)).sum())
        rel_errs.append(((on - off).norm() / off.norm()).item())
    out["agreement"] = agree / ((STEPS + 1) * PROMPTS)
    out["rel_err_by_step"] = [rel_errs[i] for i in (0, 1, 2, 8, 64, STEPS)]
    out["max_rel_err"] = max(rel_errs)
    out["num_layers"] = runner.config.num_hidden_layers
    out["graph_sizes"] = runner.graphs.sizes if runner.graphs else []
    runner.destroy()
    return out


@pytest.fixture(scope="module")
def result():
    return run_distributed(_run, device_kind="cuda", timeout_s=500)[0]


def test_fusion_is_active(result):
    assert result["status"]["active"], result["status"]


def test_every_layer_reduction_ran_fused(result):
    total, fused, flashinfer = result["prefill_counters"]
    layers = result["num_layers"]
    # 1 embedding all-reduce + 2 per layer; the per-layer ones all fuse (256 tokens <= 2048).
    assert total == 1 + 2 * layers and fused == flashinfer == 2 * layers, result["prefill_counters"]


def test_greedy_tokens_agree(result):
    print(f"greedy agreement {result['agreement']:.4f}, max logits rel err {result['max_rel_err']:.2e}")
    assert result["agreement"] >= 0.99


def test_logits_close(result):
    assert result["max_rel_err"] <= 1e-2
