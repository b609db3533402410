"""Step timing and sizing on one GPU (TP1, the tiny model with CUDA graphs): the CUDA-event step
timer against spin kernels of known relative length, the start-up step-cost measurement after
the warm-up, the capture's progress lines, and a scheduler with a step time target serving a
long prompt beside a running stream (every step within the step bound, the budget learning from
the timed steps, the outputs equal to those of a scheduler without a target)."""
import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.gpus(1)  # one rank, TP1


def _run(rank: int, world_size: int) -> dict:
    import logging

    import torch

    from arfusion.engine.common.sampling_params import SamplingParams
    from arfusion.engine.runtime.model_runner import RunnerSettings
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.runtime.step_cost import StepTimer, measure_step_cost
    from arfusion.engine.runtime.warm_up import warm_up
    from arfusion.engine.scheduling.scheduler import Scheduler
    from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
    from arfusion.fusion import FusionConfig
    from arfusion.layers.parallel_state import get_tp_group
    from tests.fake_runner import serve_all, token_ids
    from tests.test_warm_up import ListHandler

    progress = ListHandler()
    logging.getLogger("arfusion.engine.progress").addHandler(progress)
    logging.getLogger("arfusion.engine.progress").setLevel(logging.INFO)
    settings = RunnerSettings(model_path="tiny", dtype="float32", context_length=1024, max_running_requests=4,
                              cuda_graph_max_bs=4,
                              fusion=FusionConfig(enabled=False), kv_slots=4096)
    runner = build_runner(settings, get_tp_group())
    timer = StepTimer(runner.device)
    spins = {}
    for cycles in (1_000_000, 4_000_000):
        timing = timer.begin()
        torch.cuda._sleep(cycles)
        timing.end()
        spins[cycles] = timing.seconds()
    warm_up(runner, 512)
    cost = measure_step_cost(runner, 512, target_s=0.02)
    requests = [([1, 2, 3], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)),
                ([(7 * i + 5) % 250 for i in range(900)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    tokenizer = build_tiny_tokenizer()
    timed = Scheduler(runner, tokenizer, max_prefill_tokens=512, chunked_prefill_size=512, step_time_target_s=0.02)
    timed.policy.budget.start_from(cost)
    outputs = [token_ids(c) for c in serve_all(timed, requests)]
    plain = Scheduler(runner, tokenizer, max_prefill_tokens=512, chunked_prefill_size=512)
    reference = [token_ids(c) for c in serve_all(plain, requests)]
    runner.destroy()
    return {"spins": spins, "cost": cost, "learned": timed.policy.budget.cost, "outputs": outputs,
            "reference": reference, "progress": progress.lines}


@pytest.mark.timeout(300)
def test_steps_are_timed_on_the_device_and_sized_from_the_measured_cost():
    r = run_distributed(_run, world_size=1, device_kind="cuda", timeout_s=240)[0]
    print(f"\n{r['spins']} {r['cost']} {r['learned']}")
    short, long = r["spins"][1_000_000], r["spins"][4_000_000]
    assert 0 < short and 2 * short < long, "the events time the device's work"
    assert r["cost"].per_token_s > 0 and r["cost"].largest_step >= 16
    assert r["learned"] != r["cost"], "the served steps' times updated the estimate"
    assert r["outputs"] == r["reference"] and len(r["outputs"][0]) == 64, "sizing steps changes no token"
    assert any(line.startswith("capturing CUDA graphs: done, 3 batch sizes") for line in r["progress"]), r["progress"]
    assert any(line.startswith("warming up: done, ") for line in r["progress"])
