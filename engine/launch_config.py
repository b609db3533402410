"""What every TP process of a launch needs (`engine.runtime.launch.LaunchConfig`, plain values),
derived once from `ServerArgs`.

`fusion_config` is the one place where the fusion options become a `fusion.FusionConfig`: the
server, `engine.bench_one_batch` and the tuner (`engine.tune_fusion`) all call it.
"""
from __future__ import annotations

import os
import socket
from dataclasses import replace

import torch

from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.model_runner import RunnerSettings
from arfusion.fusion import FusionConfig
from arfusion.server_args import ServerArgs


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for a rendezvous or a test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_config(args: ServerArgs) -> LaunchConfig:
    """Resolve devices and the rendezvous address; ValueError for a setup that cannot run."""
    device_type = args.device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no CUDA GPU is visible")
    addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
    threads = max(1, (os.cpu_count() or 1) // max(1, args.tp_size_per_node))
    return LaunchConfig(args.tp_size, args.nnodes, args.node_rank, f"tcp://{addr}", device_type, args.dist_timeout,
                        args.log_level, runner_settings(args), threads)


def with_tokenizer_vocab(launch: LaunchConfig, vocab_size: int) -> LaunchConfig:
    """``launch`` whose ranks never sample an id ``>= vocab_size`` (the served tokenizer's
    vocabulary: the LM head may have more rows, padding)."""
    return replace(launch, runner=replace(launch.runner, tokenizer_vocab_size=vocab_size))


def fusion_config(args: ServerArgs) -> FusionConfig:
    """The fused all-reduce's config from the server options. The fused two-shot buffer holds
    the engine's largest prefill (``max_prefill_tokens`` rows): larger batches run in chunks."""
    return FusionConfig(
        enabled=args.enable_flashinfer_allreduce_fusion,
        backend=args.allreduce_fusion_backend,
        max_tokens=args.allreduce_fusion_max_tokens,
        cache_size=args.allreduce_fusion_cache_size,
        deterministic=args.deterministic,
        launch_with_pdl=not args.allreduce_fusion_disable_pdl,
        table_path=args.allreduce_fusion_table,
        symm_max_tokens=args.max_prefill_tokens,
        tune_at_startup=not args.disable_allreduce_fusion_tuning,
        tuning_cache_dir=args.allreduce_fusion_tuning_cache_dir,
    )


def runner_settings(args: ServerArgs) -> RunnerSettings:
    """What each rank's `ModelRunner` needs from the server options."""
    return RunnerSettings(
        model_path=args.model_path, load_format=args.load_format, dtype=args.dtype, seed=args.seed,
        mxfp4_experts=args.mxfp4_experts,
        context_length=args.context_length, mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests, cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_cuda_graph=args.disable_cuda_graph, norm_into_qkv=args.norm_into_qkv,
        norm_into_route=args.norm_into_route, rotary_into_attention=args.rotary_into_attention,
        disable_combine_into_norm=args.disable_combine_into_norm,
        prefetch_o_proj=args.prefetch_o_proj, prefetch_o_proj_max_batch=args.prefetch_o_proj_max_batch,
        enable_pdl=args.enable_pdl, pdl_max_batch=args.pdl_max_batch, fusion=fusion_config(args),
    )
