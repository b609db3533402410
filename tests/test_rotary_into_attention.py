"""``--rotary-into-attention`` (layers/rotary_attention.py) in a model, on the CPU.

On the CPU the attention takes its torch path, so the flag alone changes nothing: the tiny models
give the bits of the flag off, and the reason is logged. Under Triton's interpreter, with the
attention's device and dtype test patched to take the kernels (the tiny models' fp32 and head
dim 32 suit them), the flag-off run takes the torch rotary path and the Triton decode attention
and the flag-on run the fused launch in every layer of every decode step: the same greedy tokens,
logits within 1e-4 relative (the torch path's cos, sin and norm against the kernel's, in another
order). "tiny" is Llama, "tiny-moe" Qwen3-MoE (its per-head q/k norm inside the launch).
"""
import logging

import pytest
import torch

from tests.dist_utils import run_distributed, run_under_triton_interpreter
from tests.fold_checks import greedy_run

PROMPTS, PROMPT_LEN, STEPS = 3, 7, 6
MODELS = ("tiny", "tiny-moe")


def _run(rank: int, world: int, model: str, fold: bool, kernels: bool) -> dict:
    """``kernels``: the attention's Triton kernels take the CPU fp32 tensors (the interpreter)."""
    from arfusion.layers import rotary_attention
    from arfusion.layers.attention import Attention
    from arfusion.layers.kernels.triton_support import triton_available

    if kernels:
        Attention.uses_triton = lambda self, q: True
    calls = {"fused": 0}
    if triton_available():  # without triton the launch cannot run: its count stays 0
        from arfusion.layers.kernels import triton_rotary_decode_attention as fused

        launch = fused.decode_attention_rotary

        def counted(*args, **kwargs):
            calls["fused"] += 1
            return launch(*args, **kwargs)

        fused.decode_attention_rotary = counted
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    rotary_attention.logger.addHandler(handler)
    rotary_attention.logger.setLevel(logging.INFO)
    out = greedy_run(model, PROMPTS, PROMPT_LEN, STEPS, rotary_into_attention=fold)
    out.update(calls=calls["fused"], logged=logged, layers=out["config"].num_hidden_layers)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_on_the_cpu_the_flag_keeps_the_bits_and_says_why(model):
    off = run_distributed(_run, world_size=1, args=(model, False, False), timeout_s=300)[0]
    on = run_distributed(_run, world_size=1, args=(model, True, False), timeout_s=300)[0]
    assert on["tokens"] == off["tokens"] and torch.equal(on["logits"], off["logits"])
    assert on["calls"] == 0 and off["logged"] == []
    assert any("the torch attention path (cpu" in line for line in on["logged"]), on["logged"]
    assert any("prefill" in line for line in on["logged"]), on["logged"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", MODELS)
def test_the_fused_launch_inside_the_model_gives_the_same_greedy_tokens(model):
    pytest.importorskip("triton")
    off = run_under_triton_interpreter(_run, timeout_s=800, args=(model, False, True))
    on = run_under_triton_interpreter(_run, timeout_s=800, args=(model, True, True))
    assert off["calls"] == 0 and on["calls"] == STEPS * on["layers"], on["calls"]
    assert on["tokens"] == off["tokens"]
    assert len({t for step in off["tokens"] for t in step}) > 2, "the tokens vary (not a constant stream)"
    rel = (on["logits"] - off["logits"]).flatten(1).norm(dim=1) / off["logits"].flatten(1).norm(dim=1)
    assert rel.max().item() <= 1e-4


def test_the_flag_is_off_by_default_and_reaches_the_runner_and_the_benchmark():
    from arfusion.engine import bench_one_batch
    from arfusion.engine.launch_config import runner_settings
    from arfusion.server_args import ServerArgs

    assert not ServerArgs().rotary_into_attention and not runner_settings(ServerArgs()).rotary_into_attention
    assert runner_settings(ServerArgs.from_cli(["--rotary-into-attention"])).rotary_into_attention
    server, _ = bench_one_batch.parse_args(["--rotary-into-attention"])
    assert server.rotary_into_attention and "--rotary-into-attention" in bench_one_batch.build_parser().format_help()
