"""``--prefetch-o-proj`` (layers/kernels/l2_prefetch.py) on the CPU.

The prefetch launch compiled for sm90 offline (tests/offline_triton.py): one-warp programs, one
chunk a lane, the chunks covering the tensor's bytes; its PTX issues the bulk L2 prefetch with the
chunk's size in a register, only where that size is not zero. `prefetch_l2` refuses a CPU tensor
by name; `ahead` runs its block alone there and logs why once. In the tiny Llama on the CPU the
flag changes no bit of the greedy tokens or logits and says why. The flag is off by default and
reaches the runner and the benchmark."""
import logging
import sys

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.fold_checks import greedy_run

PROMPTS, PROMPT_LEN, STEPS = 3, 7, 6


@pytest.fixture
def offline():
    pytest.importorskip("triton")
    from tests import offline_triton

    return offline_triton


@pytest.mark.parametrize("total", [16, 1000, 64 * 1024, 64 * 1024 * 32 + 48, 2880 * 4096 * 2])
def test_sm90_launch_covers_the_bytes_with_bulk_prefetches(offline, monkeypatch, total):
    from arfusion.layers.kernels import l2_prefetch, triton_l2_prefetch

    kernel = offline.RecordedKernel(triton_l2_prefetch._prefetch_kernel)
    monkeypatch.setattr(triton_l2_prefetch, "_prefetch_kernel", kernel)
    flat = torch.empty(total, dtype=torch.uint8)
    triton_l2_prefetch.launch_prefetch(flat, total, l2_prefetch.CHUNK, l2_prefetch.LANES)
    (args, kwargs), = kernel.calls
    assert args == (flat, total) and kwargs == dict(CHUNK=l2_prefetch.CHUNK, LANES=l2_prefetch.LANES, num_warps=1)
    chunks = -(-total // l2_prefetch.CHUNK)
    programs = -(-chunks // l2_prefetch.LANES)
    assert (programs - 1) * l2_prefetch.LANES < chunks <= programs * l2_prefetch.LANES
    ptx = offline.compiled_asm(kernel.fn, args, kwargs)["ptx"]
    issued = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.prefetch.L2.global" in line]
    assert len(issued) == 1 and "setp.ne.b32" in issued[0], issued
    assert "@p cp.async.bulk.prefetch.L2.global [%rd" in issued[0] and "], %r" in issued[0], issued[0]


def test_a_cpu_tensor_is_refused_by_name_and_ahead_runs_the_block_alone(caplog):
    from arfusion.layers.kernels import l2_prefetch

    w = torch.randn(8, 16)
    assert l2_prefetch.prefetch_refusal(w) == "a cpu tensor"
    with pytest.raises(ValueError, match="cannot prefetch a cpu tensor into L2"):
        l2_prefetch.prefetch_l2(w)
    l2_prefetch._LOGGED.discard("a cpu tensor")
    ran = []
    with caplog.at_level(logging.INFO, logger=l2_prefetch.__name__):
        for _ in range(2):
            with l2_prefetch.ahead(w):
                ran.append(True)
    assert ran == [True] * 2
    assert [r.getMessage() for r in caplog.records] == ["L2 prefetch: a cpu tensor runs without it"]


def _run(rank: int, world: int, prefetch: bool) -> dict:
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("arfusion.layers.kernels.l2_prefetch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = greedy_run("tiny", PROMPTS, PROMPT_LEN, STEPS, prefetch_o_proj=prefetch)
    out["logged"] = logged
    return out


def test_on_the_cpu_the_flag_keeps_the_bits_and_says_why():
    off = run_distributed(_run, world_size=1, args=(False,), timeout_s=300)[0]
    on = run_distributed(_run, world_size=1, args=(True,), timeout_s=300)[0]
    assert on["tokens"] == off["tokens"] and torch.equal(on["logits"], off["logits"])
    assert off["logged"] == [] and on["logged"] == ["L2 prefetch: a cpu tensor runs without it"], on["logged"]


def test_the_flag_is_off_by_default_and_reaches_the_runner_and_the_benchmark():
    from arfusion.engine import bench_one_batch
    from arfusion.engine.launch_config import runner_settings
    from arfusion.server_args import ServerArgs

    assert not ServerArgs().prefetch_o_proj and not runner_settings(ServerArgs()).prefetch_o_proj
    assert runner_settings(ServerArgs.from_cli(["--prefetch-o-proj"])).prefetch_o_proj
    server, _ = bench_one_batch.parse_args(["--prefetch-o-proj"])
    assert server.prefetch_o_proj and "--prefetch-o-proj" in bench_one_batch.build_parser().format_help()


def test_the_batch_bound_defaults_to_one_and_reaches_the_runner_and_the_benchmark():
    from arfusion.engine import bench_one_batch
    from arfusion.engine.launch_config import runner_settings
    from arfusion.server_args import ServerArgs

    assert ServerArgs().prefetch_o_proj_max_batch == 1 and runner_settings(ServerArgs()).prefetch_o_proj_max_batch == 1
    assert runner_settings(ServerArgs.from_cli(["--prefetch-o-proj-max-batch", "4"])).prefetch_o_proj_max_batch == 4
    assert bench_one_batch.parse_args(["--prefetch-o-proj-max-batch", "0"])[0].prefetch_o_proj_max_batch == 0
    with pytest.raises(ValueError):
        ServerArgs(prefetch_o_proj_max_batch=-1)


def test_the_bound_holds_at_tp1_where_the_prefetch_runs_and_says_why_elsewhere(monkeypatch, caplog):
    from arfusion.engine.runtime import model_runner
    from arfusion.engine.runtime.model_runner import RunnerSettings, prefetch_decode_bound

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        assert prefetch_decode_bound(RunnerSettings(), cpu, 1) == 0
    assert caplog.records[-1].getMessage() == "decode batches up to 1 prefetch no o_proj weight: a cpu tensor"
    monkeypatch.setattr(model_runner.l2_prefetch, "device_refusal", lambda device: None)
    assert prefetch_decode_bound(RunnerSettings(), gpu, 1) == 1
    assert prefetch_decode_bound(RunnerSettings(prefetch_o_proj_max_batch=8), gpu, 1) == 8
    assert prefetch_decode_bound(RunnerSettings(prefetch_o_proj_max_batch=0), gpu, 1) == 0
    assert prefetch_decode_bound(RunnerSettings(prefetch_o_proj=True), gpu, 2) == sys.maxsize  # every decode batch
    assert prefetch_decode_bound(RunnerSettings(prefetch_o_proj=True), cpu, 1) == sys.maxsize  # ahead says why
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        assert prefetch_decode_bound(RunnerSettings(), gpu, 2) == 0
    assert "the TP size is 2" in caplog.records[-1].getMessage()


def _bounded_run(rank: int, world: int, prompts: int, bound: int) -> dict:
    from arfusion.engine.models import llama
    from arfusion.engine.runtime import rank_parts
    from tests.fold_checks import counting

    entered = counting(llama, "ahead")
    rank_parts.prefetch_decode_bound = lambda settings, device, tp_size: settings.prefetch_o_proj_max_batch
    out = greedy_run("tiny", prompts, PROMPT_LEN, STEPS, prefetch_o_proj_max_batch=bound)
    out["entered"] = entered[0]
    return out


@pytest.mark.parametrize("prompts", [1, 2])
def test_decode_batches_up_to_the_bound_prefetch_with_the_bits_of_none(prompts):
    none = run_distributed(_bounded_run, world_size=1, args=(prompts, 0), timeout_s=300)[0]
    bounded = run_distributed(_bounded_run, world_size=1, args=(prompts, 1), timeout_s=300)[0]
    layers = bounded["config"].num_hidden_layers
    assert none["entered"] == 0
    assert bounded["entered"] == (STEPS * layers if prompts == 1 else 0)
    assert bounded["tokens"] == none["tokens"] and torch.equal(bounded["logits"], none["logits"])
