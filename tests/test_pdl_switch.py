"""The programmatic-dependent-launch switch (layers/kernels/pdl.py) and ``--enable-pdl`` on the CPU:

- why PDL cannot run is named for each case (no CUDA device, Triton's interpreter, an AMD GPU, a
  GPU below sm90: the last two with the CUDA calls stood in), and an sm90 GPU has none;
  `pdl_mode` restores the setting it found;
- the flag: off by default, ``--enable-pdl`` parses (server and bench_one_batch), ``--device cpu``
  with it is refused naming it, and it reaches `RunnerSettings` through the launch config (what
  every TP worker is started with);
- TP2 over gloo: with the flag each rank refuses to start with the reason (`LoadRefused`, every
  rank), and with the support check stood in (as on an sm90 GPU) each rank's forward runs with
  the switch on, and leaves it off after;
- ``launch_server --enable-pdl`` at TP2 where PDL cannot run (under TRITON_INTERPRET=1, on any
  machine) exits 2 with one line naming the flag and the reason;
- ``--pdl-max-batch`` (default 1, without the flag): with the support check stood in, at TP1 a
  decode step of at most that many sequences runs with the switch on and a prefill or a larger
  decode batch with it off (the graphs' sizes follow the same rule); at TP2, or where PDL cannot
  run (the CPU), every forward keeps it off and the runner starts; a MoE model's batch whose
  experts group their slots (grouped launches, no PDL) keeps it off within the bound.
"""
from __future__ import annotations

import pytest
import torch

from arfusion.engine.launch_config import launch_config, runner_settings
from arfusion.layers.kernels import pdl
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.server_args import ServerArgs, ServerArgsError
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.timeout(300)


def _cuda_device(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], hip: str | None = None) -> torch.device:
    """A CUDA device of ``capability`` as far as `pdl.unsupported_reason` can tell."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    monkeypatch.setattr(torch.version, "hip", hip)
    return torch.device("cuda", 0)


def test_without_triton_the_reason_is_named(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(pdl, "triton_available", lambda: False)
    hopper = _cuda_device(monkeypatch, (9, 0))
    assert "triton is not installed" in pdl.unsupported_reason(hopper)
    with pytest.raises(ValueError, match=r"^--enable-pdl: triton is not installed"):
        pdl.require_supported(hopper)


def test_the_reason_pdl_cannot_run_is_named(monkeypatch: pytest.MonkeyPatch):
    triton = pytest.importorskip("triton")

    assert "not a CUDA GPU" in pdl.unsupported_reason(torch.device("cpu"))
    assert "sm80" in pdl.unsupported_reason(_cuda_device(monkeypatch, (8, 0)))
    assert "AMD" in pdl.unsupported_reason(_cuda_device(monkeypatch, (9, 4), hip="6.2"))
    hopper = _cuda_device(monkeypatch, (9, 0))
    assert pdl.unsupported_reason(hopper) is None and pdl.unsupported_reason(_cuda_device(monkeypatch, (10, 0))) is None
    pdl.require_supported(hopper)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    assert "TRITON_INTERPRET=1" in pdl.unsupported_reason(hopper)
    with pytest.raises(ValueError, match=r"^--enable-pdl: Triton's interpreter"):
        pdl.require_supported(hopper)


def test_pdl_mode_restores_the_setting_it_found():
    assert not pdl.enabled()
    with pdl.pdl_mode(True):
        assert pdl.enabled()
        with pdl.pdl_mode(False):
            assert not pdl.enabled()
        assert pdl.enabled()
    assert not pdl.enabled()
    with pytest.raises(RuntimeError), pdl.pdl_mode(True):
        raise RuntimeError
    assert not pdl.enabled()


def test_the_flag_is_off_by_default_and_reaches_the_runner_settings():
    assert ServerArgs().enable_pdl is False and runner_settings(ServerArgs()).enable_pdl is False
    args = ServerArgs.from_cli(["--enable-pdl", "--tp-size", "2"])
    assert args.enable_pdl and runner_settings(args).enable_pdl
    assert launch_config(args).runner.enable_pdl  # what each TP worker is started with
    with pytest.raises(ServerArgsError, match="enable_pdl needs an NVIDIA GPU"):
        ServerArgs.from_cli(["--enable-pdl", "--device", "cpu"])


def test_bench_one_batch_takes_the_flag():
    from arfusion.engine import bench_one_batch

    server, _ = bench_one_batch.parse_args(["--enable-pdl"])
    assert server.enable_pdl and runner_settings(server).enable_pdl
    assert bench_one_batch.parse_args([])[0].enable_pdl is False


def _build_with_pdl(rank: int, world: int, supported: bool) -> tuple[str, list[bool], bool]:
    """(how this rank's build ended, the switch in each forward, the switch after them) for the
    tiny model on the CPU with ``--enable-pdl`` (the support check stood in when ``supported``)."""
    from arfusion.engine.runtime.load_agreement import LoadRefused
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import StaticBatch
    from arfusion.layers.parallel_state import get_tp_group

    if supported:
        pdl.unsupported_reason = lambda device: None
    args = ServerArgs.from_cli(["--enable-pdl", "--tp-size", str(world), "--max-running-requests", "2",
                                "--context-length", "64"])
    try:
        runner = build_runner(launch_config(args).runner, get_tp_group())
    except LoadRefused as exc:
        return f"refused: {exc}", [], pdl.enabled()
    seen = []
    forward = runner._forward
    runner._forward = lambda plan: (seen.append(pdl.enabled()), forward(plan))[1]
    batch = StaticBatch(runner, [[1, 2, 3]], 2)
    batch.prefill()
    batch.decode([4])
    runner.destroy()
    return "built", seen, pdl.enabled()


def test_every_tp_rank_refuses_to_start_where_pdl_cannot_run():
    results = run_distributed(_build_with_pdl, world_size=2, args=(False,), timeout_s=120)
    cause = "the device is cpu, not a CUDA GPU" if triton_available() else "triton is not installed"
    reason = f"--enable-pdl: {pdl.unsupported_reason(torch.device('cpu'))}"
    assert cause in reason
    assert [outcome for outcome, _, _ in results] == [f"refused: {reason}", f"refused: TP rank 0: {reason}"]


def test_every_tp_rank_runs_its_forwards_with_the_switch_on():
    results = run_distributed(_build_with_pdl, world_size=2, args=(True,), timeout_s=180)
    assert results == [("built", [True, True], False)] * 2


def test_the_server_exits_2_naming_the_flag_and_the_reason(monkeypatch: pytest.MonkeyPatch):
    from tests.test_model_file_errors import launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # PDL cannot run there, GPU or not
    result = launch("tiny", "--tp-size", "2", "--enable-pdl")
    lines = [line for line in result.stderr.splitlines() if "--enable-pdl" in line]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: --enable-pdl: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr


def test_pdl_max_batch_defaults_to_one_and_reaches_the_runner_settings():
    from arfusion.engine import bench_one_batch

    assert ServerArgs().pdl_max_batch == 1 and runner_settings(ServerArgs()).pdl_max_batch == 1
    args = ServerArgs.from_cli(["--pdl-max-batch", "4"])
    assert launch_config(args).runner.pdl_max_batch == 4
    assert bench_one_batch.parse_args(["--pdl-max-batch", "0"])[0].pdl_max_batch == 0
    with pytest.raises(ServerArgsError, match="--pdl-max-batch: Input should be greater than or equal to 0"):
        ServerArgs.from_cli(["--pdl-max-batch", "-1"])


def _decode_switches(rank: int, world: int, supported: bool, max_batch: int) -> tuple[list[bool], list[bool], bool]:
    """(the switch in each forward: a prefill of two prompts, a decode of both, a prefill and a
    decode of one; whether graph sizes 1, 2 take PDL; the switch after) on the tiny model on the
    CPU with ``--pdl-max-batch max_batch`` (the support check stood in when ``supported``)."""
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.engine.scheduling.static_batch import StaticBatch
    from arfusion.layers.parallel_state import get_tp_group

    if supported:
        pdl.unsupported_reason = lambda device: None
    args = ServerArgs.from_cli(["--pdl-max-batch", str(max_batch), "--tp-size", str(world),
                                "--max-running-requests", "2", "--context-length", "64"])
    runner = build_runner(launch_config(args).runner, get_tp_group())
    seen = []
    forward = runner._forward
    runner._forward = lambda plan: (seen.append(pdl.enabled()), forward(plan))[1]
    pair = StaticBatch(runner, [[1, 2, 3], [5, 6]], 2)
    pair.prefill()
    pair.decode([4, 7])
    single = StaticBatch(runner, [[1, 2, 3]], 2)
    single.prefill()
    single.decode([4])
    sizes = [runner._pdl_for_decode(bs) for bs in (1, 2)]
    runner.destroy()
    return seen, sizes, pdl.enabled()


def test_decode_batches_up_to_the_bound_launch_with_pdl_at_tp1():
    assert run_distributed(_decode_switches, world_size=1, args=(True, 1), timeout_s=180) == [
        ([False, False, False, True], [True, False], False)]
    assert run_distributed(_decode_switches, world_size=1, args=(True, 0), timeout_s=180) == [
        ([False] * 4, [False, False], False)]


def test_pdl_stays_off_at_tp2_and_where_it_cannot_run():
    assert run_distributed(_decode_switches, world_size=2, args=(True, 1), timeout_s=180) == [
        ([False] * 4, [False, False], False)] * 2
    assert run_distributed(_decode_switches, world_size=1, args=(False, 1), timeout_s=180) == [
        ([False] * 4, [False, False], False)]


def _moe_decode_sizes(rank: int, world: int, grouped_from: int) -> list[bool]:
    """Whether decode sizes 1, 2, 4, 5 take PDL on the tiny MoE model (TP1, CPU, the support check
    stood in, ``--pdl-max-batch 4``), its experts grouping their slots from ``grouped_from`` tokens on
    (stood in: on the CPU they run the torch reference, which groups nothing)."""
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.layers.parallel_state import get_tp_group

    pdl.unsupported_reason = lambda device: None
    args = ServerArgs.from_cli(["--model-path", "tiny-moe", "--pdl-max-batch", "4", "--max-running-requests", "2",
                                "--context-length", "64"])
    runner = build_runner(launch_config(args).runner, get_tp_group())
    assert runner._moe_blocks, "the MoE blocks are found"
    for block in runner._moe_blocks:
        block.experts.block_m = lambda tokens, top_k: 16 if tokens >= grouped_from else None
    sizes = [runner._pdl_for_decode(bs) for bs in (1, 2, 4, 5)]
    runner.destroy()
    return sizes


def test_a_moe_batch_whose_experts_group_their_slots_keeps_pdl_off():
    assert run_distributed(_moe_decode_sizes, world_size=1, args=(99,), timeout_s=180) == [[True, True, True, False]]
    assert run_distributed(_moe_decode_sizes, world_size=1, args=(2,), timeout_s=180) == [[True, False, False, False]]
