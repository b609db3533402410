"""arfusion's vLLM plugin in vLLM on 2 GPUs (vLLM runs one TP rank per GPU): the tiny Llama of
the CPU test (tests/integrations/vllm_tp2_run.py) at TP2, compiled with CUDA graphs, with vLLM's
own unfused path and with arfusion's pass. The runner turns vLLM's own ``fuse_allreduce_rms`` off
in both runs (on Hopper it is on by default, would take every site before our pass, and the
plugin refuses it). Needs vLLM with CUDA installed (skipped without it)."""
import pytest

pytestmark = pytest.mark.gpus(2, reason="vLLM runs one TP rank per GPU")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")

from tests.integrations.vllm_tp2_run import PROMPTS, TEST_TIMEOUT_S, run_in_subprocess, write_model  # noqa: E402

pytestmark = [pytestmark, pytest.mark.timeout(TEST_TIMEOUT_S)]  # two vLLM start-ups

LOGPROB_ATOL = 0.25  # as on CPU: bf16 roundings of the fused op against vLLM's norm, at the LM head's scale


def test_vllm_tp2_with_our_pass_on_two_gpus(tmp_path):
    model_dir = write_model(tmp_path / "model")
    theirs, ours = run_in_subprocess(model_dir, "vllm"), run_in_subprocess(model_dir, "arfusion")
    for stats in ours["workers"]:
        assert sum(g["replaced"] for g in stats["graphs"]) > 0 and all(g["kept"] == 0 for g in stats["graphs"])
        assert all(set(g["forms"]) <= {"vllm::all_reduce"} for g in stats["graphs"])  # the GPU form
        (op,) = stats["ops"].values()
        assert op["backend"] == "flashinfer" and sum(op["reductions"].values()) == sum(stats["calls"].values())
        print("arfusion in vLLM on 2 GPUs:", op["reductions"], "active:", op["active"], op["reason_inactive"] or "")
    assert len(ours["tokens"]) == len(PROMPTS) and ours["tokens"] == theirs["tokens"]
    for a, b in zip(ours["prompt_logprobs"], theirs["prompt_logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_ATOL, (a, b)
