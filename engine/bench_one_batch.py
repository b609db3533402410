"""`python -m arfusion.engine.bench_one_batch`: prefill latency and decode TPOT per batch size, with
all-reduce fusion off and on, in one run (no server, no scheduler: every TP rank steps the
same static batches).

    python -m arfusion.engine.bench_one_batch --model-path llama3-8b --tp-size 2 \\
        --batch-size 1 8 32 128 256 --input-len 512 --output-len 32 --json-file out.json

Settings (``--fusion``, any of): ``off`` (NCCL + fused_add_rmsnorm), ``on`` (the fused path as
a server runs it: the measured strategy table, packaged or ``--allreduce-fusion-table``) and
``builtin`` (the fused path with the built-in rule, no table). Gains are against ``off``.
``--deterministic off on`` measures each setting in the default mode and in batch-invariant mode
(``--deterministic`` of a server) side by side in the same run and reports the cost of the
latter as ratios (``TPOT det/default``, ``prefill det/default``: mode on / mode off).

Per batch size and setting: one prefill of ``batch x input_len`` tokens (timed until its tokens
reach the host), then ``output_len - 1`` greedy decode steps (CUDA-graph replays on GPU), each
reading the last step's tokens on the device, with the host taking each step's tokens in one
step late as the server's overlap schedule does (``--disable-overlap-schedule``: right away).
TPOT = the median interval between consecutive steps' tokens reaching the host. Beside it, the
memory floor of a step at the middle of the decode (engine/step_floor.py: the bytes rank 0 reads
per step at 4.8 TB/s, H200's HBM) and TPOT / floor.
Each (setting, batch size) first runs once untimed (allocator blocks, kernel compiles), then
``--repeats`` times; the median is reported.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from arfusion.engine.common.startup import LOG_FORMAT

if TYPE_CHECKING:
    from arfusion.engine.runtime.launch import LaunchConfig

logger = logging.getLogger("arfusion.engine.bench_one_batch")
SETTINGS = ("off", "on", "builtin")
MODES = ("off", "on")  # --deterministic


# The ServerArgs fields this benchmark reads (the engine is configured as a server configures
# it); the others get no flag here: HTTP, tokenizer, multi-node and scheduling options, and the
# sizes it sets itself (context and batch from --input-len, --output-len and --batch-size; the
# fused two-shot buffer keeps a server's default of max_prefill_tokens rows).
BENCH_FIELDS = (
    "model_path", "load_format", "dtype", "device", "seed", "mxfp4_experts",
    "tp_size", "dist_timeout",
    "allreduce_fusion_backend", "allreduce_fusion_max_tokens", "allreduce_fusion_cache_size",
    "allreduce_fusion_table", "allreduce_fusion_disable_pdl", "disable_allreduce_fusion_tuning",
    "allreduce_fusion_tuning_cache_dir", "norm_into_qkv", "norm_into_route", "disable_combine_into_norm",
    "rotary_into_attention",
    "prefetch_o_proj", "prefetch_o_proj_max_batch",
    "mem_fraction_static", "disable_cuda_graph", "enable_pdl", "pdl_max_batch", "disable_overlap_schedule",
    "log_level",
)


def build_parser() -> argparse.ArgumentParser:
    """The `ServerArgs` flags of `BENCH_FIELDS` plus this benchmark's flags in their own group.
    One default differs from a server's: without a CUDA GPU the fusion backend is torch (so that
    ``--fusion on`` runs there), and the help says so."""
    from arfusion.server_args import ServerArgs

    defaults = {} if torch.cuda.is_available() else {"allreduce_fusion_backend": ("torch", "as no CUDA GPU is visible")}
    parser = ServerArgs.build_parser(prog="python -m arfusion.engine.bench_one_batch", description=__doc__,
                                     fields=BENCH_FIELDS, defaults=defaults)
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32], help="batch sizes to measure (default: 1 8 32)")
    bench.add_argument("--input-len", type=int, default=256, help="prompt tokens per sequence (default: 256)")
    bench.add_argument("--output-len", type=int, default=16, help="tokens generated per sequence (default: 16)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats of each (setting, batch size); the median is reported (default: 3)")
    bench.add_argument("--fusion", nargs="+", choices=SETTINGS, default=["off", "on"],
                       help="settings to measure, in order: off (unfused), on (the fused path with the strategy table), "
                            "builtin (the fused path with the built-in rule, no table) (default: off on)")
    bench.add_argument("--deterministic", dest="deterministic_modes", nargs="+", choices=MODES, default=["off"],
                       help="batch-invariant mode (a server's --deterministic) for each setting, in order: off, on, or "
                            "both to measure its cost side by side (default: off)")
    bench.add_argument("--json-file", help="append the results as one JSON object per line (default: none)")
    bench.add_argument("--profile", action="store_true",
                       help="GPU only: after timing, profile 10 decode steps and one prefill per batch size and "
                            "setting and print the kernel time per step (engine/step_profile.py)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[Any, argparse.Namespace]:
    """``(ServerArgs, namespace)``: the server options given (or defaulted by `build_parser`),
    and the benchmark's."""
    from arfusion.server_args import ServerArgs

    ns = build_parser().parse_args(argv)
    return ServerArgs.from_namespace(ns), ns


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(runner: Any, bs: int, input_len: int, output_len: int, vocab: int, seed: int,
            overlap: bool = True) -> dict[str, float]:
    """Prefill ms (until its tokens reach the host) and TPOT ms: the median interval between
    consecutive steps' tokens reaching the host (`StaticBatch.decode_greedy`)."""
    from arfusion.engine.scheduling.static_batch import StaticBatch, random_prompts

    batch = StaticBatch(runner, random_prompts(bs, input_len, vocab, seed), output_len)
    _sync(runner.device)
    start = time.perf_counter()
    batch.prefill_greedy().get()
    prefill_end = time.perf_counter()
    _, arrivals = batch.decode_greedy(output_len - 1, overlap)
    steps = [b - a for a, b in zip([prefill_end] + arrivals, arrivals)]
    return {"prefill_ms": (prefill_end - start) * 1e3,
            "tpot_ms": statistics.median(steps) * 1e3 if steps else float("nan")}


def run_rank(server: Any, args: argparse.Namespace, rank: int, launch: "LaunchConfig") -> list[dict[str, Any]]:
    """This rank's results: its `RankStack` (``launch``, as a server's ranks build it, with the
    benchmark's sizes and the first setting's fusion config) steps the static batches of every
    (setting, mode) and batch size; the stack is torn down in reverse at the end."""
    from contextlib import ExitStack

    from arfusion.engine.launch_config import fusion_config
    from arfusion.engine.runtime.rank_stack import build_rank
    from arfusion.engine.step_profile import PROFILE_STEPS
    from arfusion.fusion.config import NO_TABLE

    base = fusion_config(server)
    configs = {"off": replace(base, enabled=False), "on": replace(base, enabled=True),
               "builtin": replace(base, enabled=True, table_path=NO_TABLE)}
    decode_tokens = max(args.output_len, PROFILE_STEPS + 2) if args.profile else args.output_len
    runs_of = [(setting, mode == "on") for mode in args.deterministic_modes for setting in args.fusion]
    first = replace(configs[runs_of[0][0]], deterministic=runs_of[0][1])
    settings = replace(launch.runner, context_length=args.input_len + decode_tokens,
                       max_running_requests=max(args.batch_size), cuda_graph_max_bs=max(args.batch_size),
                       fusion=first)
    with ExitStack() as stack:
        ranked = build_rank(stack, launch, rank, settings=settings)
        return _measure_runs(server, args, ranked.runner, ranked.group, runs_of, configs, rank)


def _measure_runs(server: Any, args: argparse.Namespace, runner: Any, group: Any, runs_of: list[tuple[str, bool]],
                  configs: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """Each (setting, mode) of ``runs_of`` in turn (the fusion op reconfigured between them),
    each batch size measured untimed once, then ``--repeats`` times."""
    from arfusion.engine.step_floor import decode_step_bytes, floor_ms

    results = []
    for setting, deterministic in runs_of:
        config = replace(configs[setting], deterministic=deterministic)
        if config != runner.fusion.config:
            runner.reconfigure_fusion(config)
        status = runner.fusion.status()
        for bs in args.batch_size:
            # untimed: the caching allocator's blocks for this size, Triton compiles, first replays
            overlap = not server.disable_overlap_schedule
            measure(runner, bs, args.input_len, 2, runner.config.vocab_size, server.seed, overlap)
            runs = [measure(runner, bs, args.input_len, args.output_len, runner.config.vocab_size, server.seed + r,
                            overlap) for r in range(args.repeats)]
            results.append({
                "fusion": setting, "deterministic": deterministic, "fusion_active": status["active"],
                "strategy_table": status["measured_strategy_table"],
                "fusion_reason_inactive": status["reason_inactive"], "batch_size": bs, "overlap": overlap,
                "shared_gpu": group.shared_gpu_note,
                "prefill_ms": statistics.median(r["prefill_ms"] for r in runs),
                "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
                "floor_ms": floor_ms(decode_step_bytes(runner.model, bs, args.input_len + args.output_len // 2)),
            })
            if args.profile and runner.device.type == "cuda":
                from arfusion.engine.step_profile import format_profile, profile_decode_steps, profile_prefill, with_tpot

                prof = with_tpot(profile_decode_steps(runner, bs, args.input_len, runner.config.vocab_size, server.seed,
                                                      overlap=overlap), results[-1]["tpot_ms"])
                prefill = profile_prefill(runner, bs, args.input_len, runner.config.vocab_size, server.seed)
                results[-1]["profile"], results[-1]["prefill_profile"] = prof, prefill
                if rank == 0:
                    print(format_profile(prof, _label(setting, deterministic)), flush=True)
                    print(format_profile(prefill, _label(setting, deterministic) + " prefill"), flush=True)
    return results


def report(server: Any, args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    shared = next((r["shared_gpu"] for r in results if r.get("shared_gpu")), None)
    if shared:
        print(f"NOT REPRESENTATIVE (every row is 'shared GPU'): {shared}")
    print(format_table(server, args, results))
    inactive = {r["fusion_reason_inactive"] for r in results if r["fusion"] != "off" and not r["fusion_active"]}
    for reason in inactive:
        print(f"note: fusion was requested but inactive: {reason}")
    if args.json_file:
        with open(args.json_file, "a") as f:
            f.write(json.dumps({"args": {**server.model_dump(), **vars(args)}, "results": results}) + "\n")


def _label(setting: str, deterministic: bool) -> str:
    """A column's name: the fusion setting, with " det" in batch-invariant mode."""
    return setting + (" det" if deterministic else "")


def format_table(server: Any, args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    """Prefill ms and TPOT ms per batch size and (setting, mode); TPOT and prefill gains against
    ``off`` in the same mode; with both modes, the cost of batch-invariant mode per setting
    (TPOT and prefill of mode on / mode off)."""
    by = {(_label(r["fusion"], r.get("deterministic", False)), r["batch_size"]): r for r in results}
    modes = [m == "on" for m in args.deterministic_modes]
    measured = [_label(s, d) for d in modes for s in args.fusion]
    compared = [(_label(s, d), _label("off", d)) for d in modes for s in args.fusion if s != "off"] \
        if "off" in args.fusion else []
    costs = [(_label(s, True), _label(s, False)) for s in args.fusion] if len(set(modes)) == 2 else []
    head = ([f"prefill {s}" for s in measured] + [f"TPOT {s}" for s in measured] + ["floor"]
            + [f"TPOT/floor {s}" for s in measured]
            + [f"TPOT gain {s}" for s, _ in compared] + [f"prefill gain {s}" for s, _ in compared]
            + [f"TPOT det/default {s}" for _, s in costs] + [f"prefill det/default {s}" for _, s in costs])
    schedule = "no overlap" if server.disable_overlap_schedule else "overlap"
    schedule += " norm-into-qkv" if server.norm_into_qkv else ""
    schedule += " norm-into-route" if server.norm_into_route else ""
    schedule += " no-combine-into-norm" if server.disable_combine_into_norm else ""
    schedule += " rotary-into-attention" if server.rotary_into_attention else ""
    schedule += (" prefetch-o-proj" if server.prefetch_o_proj
                 else f" prefetch-o-proj<={server.prefetch_o_proj_max_batch}" if server.prefetch_o_proj_max_batch else "")
    schedule += " pdl" if server.enable_pdl else f" pdl<={server.pdl_max_batch}" if server.pdl_max_batch else ""
    lines = [f"model={server.model_path} tp={server.tp_size} input_len={args.input_len} output_len={args.output_len} "
             f"{schedule} (ms; floor = bytes a decode step reads / 4.8 TB/s; gain = 1 - setting / off; "
             "det/default = batch-invariant mode / default mode)",
             f"{'batch':>5} " + " ".join(f"{h:>17}" for h in head)]
    for bs in args.batch_size:
        def cell(label: str, key: str) -> str:
            r = by.get((label, bs))
            return f"{r[key]:.3f}" if r else "-"

        def gain(label: str, base: str, key: str) -> str:
            off, r = by.get((base, bs)), by.get((label, bs))
            return f"{(1 - r[key] / off[key]) * 100:+.1f}%" if off and r else "-"

        def ratio(label: str, base: str, key: str) -> str:
            default, r = by.get((base, bs)), by.get((label, bs))
            return f"{r[key] / default[key]:.3f}x" if default and r else "-"

        def over_floor(label: str) -> str:
            r = by.get((label, bs))
            return f"{r['tpot_ms'] / r['floor_ms']:.2f}x" if r else "-"

        floor = next((f"{r['floor_ms']:.3f}" for (_, b), r in by.items() if b == bs), "-")
        cells = ([cell(s, "prefill_ms") for s in measured] + [cell(s, "tpot_ms") for s in measured] + [floor]
                 + [over_floor(s) for s in measured]
                 + [gain(s, b, "tpot_ms") for s, b in compared] + [gain(s, b, "prefill_ms") for s, b in compared]
                 + [ratio(s, b, "tpot_ms") for s, b in costs] + [ratio(s, b, "prefill_ms") for s, b in costs])
        shared = any(r.get("shared_gpu") for (_, b), r in by.items() if b == bs)
        lines.append(f"{bs:>5} " + " ".join(f"{c:>17}" for c in cells) + ("  shared GPU" if shared else ""))
    return "\n".join(lines)


def _worker(rank: int, server: Any, args: argparse.Namespace, launch: "LaunchConfig", queue: Any) -> None:
    # a spawned process starts without the parent's logging set-up: the rank's own, as a server's
    logging.basicConfig(level=server.log_level.upper(), format=LOG_FORMAT.format(rank=rank))
    try:
        queue.put((rank, run_rank(server, args, rank, launch), None))
    except Exception as exc:
        logger.exception("rank %d failed", rank)
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        queue.close()
        queue.join_thread()  # the result must leave this process before the hard exit
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown: NCCL/IPC destructors can hang at exit


def main(argv: Optional[Sequence[str]] = None) -> int:
    import multiprocessing as mp

    from arfusion.engine.launch_config import launch_config

    server, args = parse_args(argv)
    logging.basicConfig(level=server.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        launch = launch_config(server)  # the ranks' devices and rendezvous, as a server's
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, server, args, launch, queue)) for r in range(server.tp_size)]
    for p in procs:
        p.start()
    outcome = {}
    while len(outcome) < server.tp_size:
        try:
            rank, res, err = queue.get(timeout=5)
            outcome[rank] = (res, err)
        except Exception:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome]
            if dead:
                print(f"error: rank(s) {dead} died without a result", file=sys.stderr)
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = {r: e for r, (_, e) in outcome.items() if e}
    if errors or 0 not in outcome:
        print(f"error: {errors or 'rank 0 produced no result'}", file=sys.stderr)
        return 1
    report(server, args, outcome[0][0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
