"""``--mxfp4-experts tensor-cores``: gpt-oss's kept MXFP4 experts on the tensor-core launches
(layers/moe/kernels/gluon_mxfp4_experts.py) at every batch, from the flag to the kernel choice:

- ServerArgs takes it, with ``--deterministic`` too, and refuses it with ``--device cpu``;
- the runner's settings keep the experts in MXFP4 and mark the config (`ModelConfig.mxfp4_tensor_cores`,
  which needs them kept); a GptOssExperts in bf16 form refuses ``tensor_cores``;
- a runner on the CPU refuses it at start-up (a tiny gpt-oss MXFP4 checkpoint), naming the flag;
- `tensor_core_config` gives valid tiles at gpt-oss's shapes (TP1, TP2, TP4) for every rows per
  expert, K steps that divide K (of 512 up to `LONG_K_MAX_SLOTS` slots and 256 up to `MID_K_MAX_ROWS` rows per expert outside
  batch-invariant mode, with tail steps), blocks that hold the mean rows per expert; in
  batch-invariant mode the same K steps at every batch;
- `gpt_oss_experts_triton` (its launches recorded, nothing run) takes those tiles for experts
  marked ``tensor_cores``, in batch-invariant mode too (the launches are batch-invariant by
  construction), and otherwise the matrix-vector launches, or the grouped batch-invariant tiles
  in batch-invariant mode;
- unmarked experts whose tensor-core launches are refused take the launches before, the reason
  logged once as a warning.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.runtime.model_runner import RunnerSettings, _run_form, keep_mxfp4
from arfusion.layers import batch_invariant
from arfusion.layers.moe.kernels.mxfp4_moe_config import (LONG_K_MAX_SLOTS, MID_K_MAX_ROWS, check_config,
                                                          tensor_core_config)
from arfusion.server_args import ServerArgs, ServerArgsError
from tests.dist_utils import run_distributed


def test_server_args_take_the_choice_and_refuse_it_where_it_cannot_run():
    assert ServerArgs.from_cli(["--mxfp4-experts", "tensor-cores"]).mxfp4_experts == "tensor-cores"
    assert ServerArgs.from_cli(["--mxfp4-experts", "tensor-cores", "--deterministic"]).deterministic
    with pytest.raises(ServerArgsError, match="runs on a GPU; with device cpu use keep or dequantize"):
        ServerArgs.from_cli(["--mxfp4-experts", "tensor-cores", "--device", "cpu"])


def _mxfp4_config(**changes) -> ModelConfig:
    from arfusion.engine.models.builtin import builtin_config

    return dataclasses.replace(builtin_config("gpt-oss-20b"), **changes)


def test_the_settings_keep_the_experts_and_mark_the_config():
    cpu = torch.device("cpu")
    assert keep_mxfp4("tensor-cores", cpu) and keep_mxfp4("keep", cpu) and not keep_mxfp4("dequantize", cpu)
    config = _mxfp4_config()
    marked = _run_form(config, RunnerSettings(model_path="gpt-oss-20b", mxfp4_experts="tensor-cores"), cpu)
    assert marked.keep_mxfp4 and marked.mxfp4_tensor_cores
    kept = _run_form(config, RunnerSettings(model_path="gpt-oss-20b", mxfp4_experts="keep"), cpu)
    assert kept.keep_mxfp4 and not kept.mxfp4_tensor_cores
    with pytest.raises(ValueError, match="needs the mxfp4 experts kept"):
        _mxfp4_config(keep_mxfp4=False, mxfp4_tensor_cores=True)


def test_bf16_form_experts_refuse_tensor_cores():
    from arfusion.layers.moe.gpt_oss_moe import GptOssExperts

    with pytest.raises(ValueError, match="MXFP4 experts only"):
        GptOssExperts(4, 64, 64, 1.702, 7.0, False, torch.float32, None, tensor_cores=True)


def _start_on_cpu(rank: int, world: int, path: str) -> str:
    from arfusion.engine.runtime.rank_parts import build_runner
    from arfusion.layers.parallel_state import get_tp_group

    try:
        build_runner(RunnerSettings(model_path=path, mxfp4_experts="tensor-cores", context_length=64, kv_slots=64,
                                    max_running_requests=2), get_tp_group())
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.timeout(300)
def test_a_runner_on_the_cpu_refuses_it_naming_the_flag(tmp_path):
    from tests.gpt_oss_checkpoints import build_checkpoints

    _, _, mxfp4_dir = build_checkpoints(tmp_path)
    message = run_distributed(_start_on_cpu, world_size=1, args=(str(mxfp4_dir),), timeout_s=240)[0]
    assert "--mxfp4-experts tensor-cores" in message and "keep or dequantize" in message, message


@pytest.mark.parametrize("inter", [2880, 1440, 736])
@pytest.mark.parametrize("num_slots", [4, 8, 16, 17, 32, 43, 44, 48, 64, 65, 256, 288, 512, 544, 1024, 1056, 9600])
def test_tensor_core_tiles_are_valid_at_gpt_oss_shapes(inter, num_slots):
    cfg = tensor_core_config(num_slots, 32, 2880, inter)
    check_config(cfg, True)
    rows_per_expert = num_slots / 32
    assert cfg.tensor_cores
    if num_slots <= LONG_K_MAX_SLOTS:  # long K steps, the rest in steps of its powers of two
        assert cfg.block_k_gate_up == cfg.block_k_down == 512 and not cfg.prefetch
    elif rows_per_expert <= MID_K_MAX_ROWS:
        assert cfg.block_k_gate_up == cfg.block_k_down == 256
    else:
        assert 2880 % cfg.block_k_gate_up == 0 and inter % cfg.block_k_down == 0
    assert cfg.block_m >= min(rows_per_expert, 64) and (cfg.block_m == 8 or cfg.block_m / 2 < rows_per_expert)
    assert cfg.prefetch == (num_slots >= 44)  # 32 experts: 24.1 expected active at 44 slots, 23.6 at 43


@pytest.mark.parametrize("inter", [2880, 1440, 736])
def test_tensor_core_sums_follow_the_shapes_only(inter):
    """What orders a row's sums (the K steps; the launches, mma.sync m16n8k16 in every block) is
    the same at every batch: batch-invariant mode may take these tiles at every batch."""
    tiles = {tensor_core_config(slots, 32, 2880, inter, batch_invariant=True)
             for slots in (4, 32, 256, 288, 512, 1056, 2048, 9600)}
    assert len({(t.block_k_gate_up, t.block_k_down, t.tensor_cores, t.split_k_down) for t in tiles}) == 1
    assert {t.block_m for t in tiles} == {8, 16, 64}


def _stand_in(tensor_cores: bool, top_scale: int) -> SimpleNamespace:
    """What `gpt_oss_experts_triton` reads of a `GptOssExperts` before its launches (CPU tensors,
    scales of at most ``top_scale``)."""
    scales = torch.full((4, 8), 120, dtype=torch.uint8)
    scales[1, 2] = top_scale
    return SimpleNamespace(hidden_size=2880, local=1440, num_experts=32, mxfp4=True, tensor_cores=tensor_cores,
                           w13_scales=scales, w2_scales=scales)


# (tokens, marked tensor_cores, batch-invariant mode, largest scale byte) -> the launches chosen
CHOICES = {
    (1, False, False, 120): "gemv_partials",  # 4 slots: the matrix-vector launches, faster there
    (2, False, False, 120): "_tensor_core_partials",  # 8 slots: TENSOR_CORE_MIN_SLOTS, K steps of 512
    (8, False, False, 120): "_tensor_core_partials",  # 32 slots
    (2, False, True, 120): "_tensor_core_partials",  # batch-invariant mode: at every batch
    (8, True, False, 120): "_tensor_core_partials",
    (2, True, False, 120): "_tensor_core_partials",  # marked, 8 slots: K steps of 512
    (2, True, True, 120): "_tensor_core_partials",
    (8, False, False, 129): "gemv_partials",  # a scale the tensor-core decoder cannot hold: the launches before
    (8, False, True, 129): "_grouped_partials",  # ... and batch-invariant mode's grouped tiles
}


@pytest.mark.parametrize("case", CHOICES, ids=lambda c: "tokens{}-{}-{}-scale{}".format(
    c[0], "marked" if c[1] else "unmarked", "deterministic" if c[2] else "default", c[3]))
def test_the_experts_launch_what_their_mark_the_mode_and_the_batch_ask_for(monkeypatch, case):
    pytest.importorskip("triton")
    from arfusion.layers.moe.kernels import triton_mxfp4_moe, triton_topk_combine
    from tests.offline_triton import RecordedKernel

    tokens, tensor_cores, deterministic, top_scale = case
    chosen = []

    def record(name):
        def partials(x, experts, topk_ids, *blocks_and_cfg):
            chosen.append((name, blocks_and_cfg[-1]))
            return torch.zeros(1, topk_ids.numel(), x.shape[1])
        return partials

    for name in ("_tensor_core_partials", "_grouped_partials", "gemv_partials"):
        monkeypatch.setattr(triton_mxfp4_moe, name, record(name))
    monkeypatch.setattr(triton_mxfp4_moe, "_expert_blocks", lambda ids, experts, block_m: None)
    monkeypatch.setattr(triton_topk_combine, "_topk_combine_kernel", RecordedKernel(triton_topk_combine._topk_combine_kernel))
    ids = torch.stack([torch.randperm(32, generator=torch.Generator().manual_seed(t))[:4] for t in range(tokens)]).int()
    with batch_invariant.batch_invariant_mode(deterministic):
        triton_mxfp4_moe.gpt_oss_experts_triton(torch.zeros(tokens, 2880, dtype=torch.bfloat16),
                                                _stand_in(tensor_cores, top_scale), torch.full((tokens, 4), 0.25), ids)
    [(name, cfg)] = chosen
    assert name == CHOICES[case]
    if name == "_tensor_core_partials":
        assert cfg == tensor_core_config(tokens * 4, 32, 2880, 1440, batch_invariant=deterministic)
    if name == "_grouped_partials":
        assert cfg.block_k_gate_up == cfg.block_k_down == 128 and not cfg.swap  # batch-invariant mode's pins


def test_a_refusal_of_the_tensor_core_launches_is_logged_once(caplog, monkeypatch):
    """Unmarked experts whose tensor-core launches are refused (here: fp16 activations) take the
    launches before, and the reason is logged once a process, as a warning."""
    pytest.importorskip("triton")
    import logging

    from arfusion.layers.moe.kernels import triton_mxfp4_moe

    monkeypatch.setattr(triton_mxfp4_moe, "_REFUSALS_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger=triton_mxfp4_moe.__name__):
        configs = [triton_mxfp4_moe.default_config(_stand_in(False, 120), 32, torch.float16) for _ in range(2)]
    assert not any(cfg.tensor_cores for cfg in configs)
    warned = [r.getMessage() for r in caplog.records if r.name == triton_mxfp4_moe.__name__]
    assert len(warned) == 1 and "bf16 activations, got torch.float16" in warned[0], warned
