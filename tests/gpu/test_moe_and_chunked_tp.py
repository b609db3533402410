"""TP2 on the GPU for the MoE models and chunked prefill (two GPUs, or two ranks sharing one).

MoE (``tiny-moe`` and Qwen3-30B-A3B's shapes, dummy weights, bf16): teacher-forced logits of
fusion on (flashinfer strategies; the experts' top-k combine folded into the fused reduction)
against fusion off, and against the torch backend (the same math as off, only the norm rounded
differently). The fused model must perturb the logits no more than that rounding change does
(mean relative error at most 1.5x the torch backend's, greedy agreement at most 2 points
lower), and every layer's two reductions must run fused.

Chunked prefill: the CPU test's schedules (chunked and unchunked, overlap on and off, greedy
and a seeded sampled request) on the GPU with the tiny model in fp32 and flashinfer fusion:
every schedule gives the unchunked schedule's tokens.
"""
import pytest
import torch

from tests.dist_utils import gpu_world_size, run_distributed
from tests.static_batch_logits import batch_logits

pytestmark = pytest.mark.tp_ranks(gpu_world_size())  # one rank per GPU, or ranks sharing a GPU

PROMPTS, PROMPT_LEN, STEPS = 4, 24, 24
MOE_MODELS = ("tiny-moe", "qwen3-30b-a3b")


def _compare(a, b):
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = (a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)
    return {"agreement": agree, "mean_rel_err": rel.mean().item(), "max_rel_err": rel.max().item()}


def _moe(rank, world_size):
    from dataclasses import replace

    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group

    group = get_tp_group()
    off = FusionConfig(enabled=False, backend="flashinfer", max_tokens=1024)
    out = {"shared_gpu": group.shares_gpu}
    for name in MOE_MODELS:
        settings = RunnerSettings(model_path=name, dtype="bfloat16", context_length=PROMPT_LEN + STEPS + 8,
                                  max_running_requests=PROMPTS, cuda_graph_max_bs=PROMPTS, fusion=off, kv_slots=2048)
        runner = build_runner(settings, group)
        prompts = random_prompts(PROMPTS, PROMPT_LEN, runner.config.vocab_size, seed=3)
        unfused, tokens = batch_logits(runner, prompts, STEPS)  # the unfused model's own greedy stream
        runner.reconfigure_fusion(replace(off, enabled=True))
        status = runner.fusion.status()
        runner.fusion.counts.clear()
        StaticBatch(runner, prompts, 1).prefill()
        counts = dict(runner.fusion.counts)
        fused = batch_logits(runner, prompts, STEPS, tokens)[0]
        runner.reconfigure_fusion(replace(off, enabled=True, backend="torch"))
        torch_backend = batch_logits(runner, prompts, STEPS, tokens)[0]
        out[name] = {"active": status["active"], "prefill_counts": counts,
                     "layers": runner.config.num_hidden_layers,
                     "fused_vs_unfused": _compare(fused, unfused), "torch_vs_unfused": _compare(torch_backend, unfused)}
        runner.destroy()
        del runner
        torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def moe():
    r = run_distributed(_moe, world_size=gpu_world_size(), device_kind="cuda", timeout_s=600)[0]
    for name in MOE_MODELS:
        print(f"\n{name}: {r[name]}")
    return r


@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_layers_reduce_fused(moe, name):
    r = moe[name]
    assert r["active"], r
    fused = sum(n for s, n in r["prefill_counts"].items() if s != "nccl")
    assert fused == 2 * r["layers"], r["prefill_counts"]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_fused_perturbs_no_more_than_a_rounding_change(moe, name):
    fused, torch_backend = moe[name]["fused_vs_unfused"], moe[name]["torch_vs_unfused"]
    assert fused["mean_rel_err"] <= 1.5 * torch_backend["mean_rel_err"], moe[name]
    assert fused["agreement"] >= torch_backend["agreement"] - 0.02, moe[name]


def _chunked(rank, world_size):
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.runtime.step_plan import StepPlan
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group
    from tests.plan_follower import follow_plans
    from tests.test_chunked_prefill_model import SCHEDULES, _serve

    settings = RunnerSettings(model_path="tiny", dtype="float32", context_length=256, max_running_requests=4,
                              kv_slots=1024, fusion=FusionConfig(enabled=True, backend="flashinfer", max_tokens=256))
    runner = build_runner(settings, get_tp_group())
    try:
        active = runner.fusion.active
        if rank != 0:
            return {"steps": follow_plans(runner)}
        results = {schedule: _serve(runner, *schedule)[0] for schedule in SCHEDULES}
        runner.group.broadcast_object(StepPlan("shutdown"))
        return {"active": active, "results": results}
    finally:
        runner.destroy()


def test_chunked_prefill_gives_the_unchunked_tokens():
    r = run_distributed(_chunked, world_size=gpu_world_size(), device_kind="cuda", timeout_s=400)[0]
    assert r["active"]
    reference = r["results"][(-1, False)]
    for schedule, tokens in r["results"].items():
        assert tokens == reference, schedule
