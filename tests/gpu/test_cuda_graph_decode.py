"""Decode steps replayed from CUDA graphs against the same model run eagerly, on one GPU.

The graph path is what a served decode step runs: `DecodeBuffers` (one packed host-to-device
copy of the step's integers, one index_put into the request table), attention reading the
whole table through row ids, and the fused rotary + KV-cache write. The eager path gathers the
plan's rows (`RequestTable.apply`). The built-in tiny model with dummy weights, fp32 and bf16;
three and four sequences in scattered table rows (three pad to the graph of four); greedy
decode teacher-forced from the eager run, every other step through the graph runner's
committed device tokens (`commit_tokens`, a ``tokens_on_device`` plan). Per step, the graph's logits must be within a
relative L2 error of the eager ones (1e-4 in fp32; 2e-2 in bf16, where a different split of
the decode attention or a padded GEMM rounds differently), and both runners' request tables
must be equal, the padding row untouched. Every step's greedy tokens (taken over the
vocabulary shards inside the graph) must be the argmax of its gathered logits.

The same at TP2 (``tp_ranks``), fusion off and on: on one GPU the ranks share it, their device
group is gloo, and the decode graphs capture the group's symmetric-memory stand-in for its
collectives (`fusion.capturable`) instead: graphs must be on, and the logits as close to eager.
"""
import pytest
import torch

from tests.dist_utils import gpu_world_size, run_distributed

pytestmark = pytest.mark.gpus(1)  # one rank, TP1

PROMPT_LEN, STEPS, CONTEXT = 16, 32, 64
ROWS = [5, 2, 7, 0]  # of 8: sequence b does not sit in row b
MAX_REL_ERR = {"float32": 1e-4, "bfloat16": 2e-2}


def _run(rank: int, world_size: int, dtype: str, fusion: bool = False) -> dict:
    from dataclasses import replace

    from arfusion.engine.scheduling.kv_pool import SlotAllocator
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import random_prompts
    from arfusion.engine.runtime.step_plan import StepPlan
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group

    settings = RunnerSettings(model_path="tiny", dtype=dtype, context_length=CONTEXT, max_running_requests=8,
                              cuda_graph_max_bs=4, fusion=FusionConfig(enabled=fusion), kv_slots=2048)
    graphed = build_runner(settings, get_tp_group())
    eager = build_runner(replace(settings, disable_cuda_graph=True), get_tp_group())
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4] and eager.graphs is None
    runners = {"graph": graphed, "eager": eager}
    out = {}
    for bs in (3, 4):
        prompts = random_prompts(bs, PROMPT_LEN, graphed.config.vocab_size, seed=bs)
        allocator = SlotAllocator(graphed.num_kv_slots)
        slots = [allocator.allocate(PROMPT_LEN + STEPS) for _ in prompts]
        rows, lens = ROWS[:bs], [PROMPT_LEN] * bs
        prefill = StepPlan("extend", rows, prompts, [s[:PROMPT_LEN] for s in slots], lens, gather_logits=True)
        logits = {name: [runner.forward(prefill).full.clone()] for name, runner in runners.items()}
        greedy_is_argmax = True
        for step in range(STEPS):
            tokens = logits["eager"][-1].argmax(-1).tolist()
            lens = [n + 1 for n in lens]
            plan = StepPlan("decode", rows, [[t] for t in tokens], [[s[n - 1]] for s, n in zip(slots, lens)], lens,
                            gather_logits=True)
            # every other step the graph reads the tokens committed on the device (the served path)
            graphed.commit_tokens(torch.tensor(tokens, device=graphed.device))
            plans = {"graph": replace(plan, new_tokens=[], tokens_on_device=True) if step % 2 else plan, "eager": plan}
            for name, runner in runners.items():
                step_logits = runner.forward(plans[name])
                greedy_is_argmax &= torch.equal(step_logits.greedy_tokens, step_logits.full.argmax(-1))
                logits[name].append(step_logits.full.clone())  # graph outputs are overwritten by the next replay
        graph, ref = torch.stack(logits["graph"][1:]), torch.stack(logits["eager"][1:])  # [STEPS, bs, vocab]
        out[bs] = {
            "max_rel_err": ((graph - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max().item(),
            "agreement": (graph.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "tables_equal": torch.equal(graphed.table.table, eager.table.table),
            "pad_row_zero": not graphed.table.table[graphed.table.pad_row].any().item(),
            "greedy_is_argmax": greedy_is_argmax,
        }
    graphed.destroy()
    eager.destroy()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_matches_eager_decode(dtype):
    result = run_distributed(_run, world_size=1, args=(dtype,), device_kind="cuda", timeout_s=240)[0]
    print(f"\n{dtype}: {result}")
    for bs, r in result.items():
        assert r["tables_equal"] and r["pad_row_zero"] and r["greedy_is_argmax"], (bs, r)
        assert r["max_rel_err"] <= MAX_REL_ERR[dtype], (bs, r)


@pytest.mark.tp_ranks(gpu_world_size())
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fusion", [False, True], ids=["fusion-off", "fusion-on"])
def test_tp_graph_decode_matches_eager_decode_also_with_ranks_sharing_a_gpu(fusion):
    per_rank = run_distributed(_run, world_size=gpu_world_size(), args=("bfloat16", fusion), device_kind="cuda",
                               timeout_s=500)
    print(f"\nTP{gpu_world_size()} fusion {fusion}: {per_rank[0]}")
    for result in per_rank:
        for bs, r in result.items():
            assert r["tables_equal"] and r["pad_row_zero"] and r["greedy_is_argmax"], (bs, r)
            assert r["max_rel_err"] <= MAX_REL_ERR["bfloat16"], (bs, r)
