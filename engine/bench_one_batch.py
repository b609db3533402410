"""`python -m engine.bench_one_batch`: prefill latency and decode TPOT per batch size, with
all-reduce fusion off and on, in one run (no server, no scheduler: every TP rank steps the
same static batches).

    python -m engine.bench_one_batch --model-path llama3-8b --tp-size 2 \\
        --batch-size 1 8 32 128 256 --input-len 512 --output-len 32 --json-file out.json

Settings (``--fusion``, any of): ``off`` (NCCL + fused_add_rmsnorm), ``on`` (the fused path as
a server runs it: the measured strategy table, packaged or ``--allreduce-fusion-table``) and
``builtin`` (the fused path with the built-in thresholds, no table). Gains are against ``off``.

Per batch size and setting: one prefill of ``batch x input_len`` tokens (timed until its tokens
reach the host), then ``output_len - 1`` greedy decode steps (CUDA-graph replays on GPU), each
reading the last step's tokens on the device, with the host taking each step's tokens in one
step late as the server's overlap schedule does (``--disable-overlap-schedule``: right away).
TPOT = the median interval between consecutive steps' tokens reaching the host.
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
from typing import Any, Optional, Sequence

import torch

logger = logging.getLogger("engine.bench_one_batch")
SETTINGS = ("off", "on", "builtin")
# rows per chunk of the fused two-shot strategy in prefills (as a server's --max-prefill-tokens):
# 16384 x 4096 bf16 is 256 MiB of symmetric buffer per rank; larger prefills run in chunks
SYMM_CHUNK_ROWS = 16384


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="tiny", help="built-in name, HF directory or .gguf file")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="repeats of each (setting, batch size); median reported")
    p.add_argument("--fusion", nargs="+", choices=SETTINGS, default=["off", "on"], help="settings to measure, in order")
    p.add_argument("--allreduce-fusion-table", default=None,
                   help="strategy table of the 'on' setting (default: the packaged one)")
    p.add_argument("--allreduce-fusion-backend", choices=["flashinfer", "torch"], default=None,
                   help="default: flashinfer on GPU, torch on CPU")
    p.add_argument("--allreduce-fusion-max-tokens", type=int, default=2048)
    p.add_argument("--allreduce-fusion-disable-pdl", action="store_true",
                   help="launch the flashinfer fused kernel without programmatic dependent launch")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="take each step's tokens to the host before launching the next step")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--json-file", help="append the results as one JSON object per line (rank 0)")
    p.add_argument("--profile", action="store_true",
                   help="GPU only: after timing, profile 10 decode steps per batch size and setting and print "
                        "the kernel time per step (benchmarks/step_profile.py)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(runner: Any, bs: int, input_len: int, output_len: int, vocab: int, seed: int,
            overlap: bool = True) -> dict[str, float]:
    """Prefill ms (until its tokens reach the host) and TPOT ms: the median interval between
    consecutive steps' tokens reaching the host (`StaticBatch.decode_greedy`)."""
    from engine.scheduling.static_batch import StaticBatch, random_prompts

    batch = StaticBatch(runner, random_prompts(bs, input_len, vocab, seed), output_len)
    _sync(runner.device)
    start = time.perf_counter()
    batch.prefill_greedy().get()
    prefill_end = time.perf_counter()
    _, arrivals = batch.decode_greedy(output_len - 1, overlap)
    steps = [b - a for a, b in zip([prefill_end] + arrivals, arrivals)]
    return {"prefill_ms": (prefill_end - start) * 1e3,
            "tpot_ms": statistics.median(steps) * 1e3 if steps else float("nan")}


def run_rank(args: argparse.Namespace, rank: int, init_method: str) -> list[dict[str, Any]]:
    from engine.runtime.model_runner import ModelRunner, RunnerSettings
    from fusion import FusionConfig
    from fusion.allreduce_fusion import NO_TABLE
    from layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    backend = args.allreduce_fusion_backend or ("flashinfer" if use_cuda else "torch")
    group = init_tensor_parallel(args.tp_size, rank, init_method, device=device, timeout_s=300)
    base = FusionConfig(enabled=False, backend=backend, max_tokens=args.allreduce_fusion_max_tokens,
                        symm_max_tokens=max(args.allreduce_fusion_max_tokens, SYMM_CHUNK_ROWS),
                        launch_with_pdl=not args.allreduce_fusion_disable_pdl)
    configs = {"off": base, "on": replace(base, enabled=True, table_path=args.allreduce_fusion_table),
               "builtin": replace(base, enabled=True, table_path=NO_TABLE)}
    fusion = configs[args.fusion[0]]
    from benchmarks.step_profile import PROFILE_STEPS

    decode_tokens = max(args.output_len, PROFILE_STEPS + 2) if args.profile else args.output_len
    settings = RunnerSettings(model_path=args.model_path, load_format=args.load_format, dtype=args.dtype, seed=args.seed,
                              context_length=args.input_len + decode_tokens, mem_fraction_static=args.mem_fraction_static,
                              max_running_requests=max(args.batch_size), cuda_graph_max_bs=max(args.batch_size),
                              disable_cuda_graph=args.disable_cuda_graph, fusion=fusion)
    runner = ModelRunner(settings, group)
    results = []
    try:
        for setting in args.fusion:
            if configs[setting] != runner.fusion.config:
                runner.reconfigure_fusion(configs[setting])
            status = runner.fusion.status()
            for bs in args.batch_size:
                # untimed: the caching allocator's blocks for this size, Triton compiles, first replays
                overlap = not args.disable_overlap_schedule
                measure(runner, bs, args.input_len, 2, runner.config.vocab_size, args.seed, overlap)
                runs = [measure(runner, bs, args.input_len, args.output_len, runner.config.vocab_size, args.seed + r,
                                overlap) for r in range(args.repeats)]
                results.append({
                    "fusion": setting, "fusion_active": status["active"],
                    "strategy_table": status["measured_strategy_table"],
                    "fusion_reason_inactive": status["reason_inactive"], "batch_size": bs, "overlap": overlap,
                    "prefill_ms": statistics.median(r["prefill_ms"] for r in runs),
                    "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
                })
                if args.profile and runner.device.type == "cuda":
                    from benchmarks.step_profile import format_profile, profile_decode_steps

                    prof = profile_decode_steps(runner, bs, args.input_len, runner.config.vocab_size, args.seed,
                                                overlap=overlap)
                    results[-1]["profile"] = prof
                    if rank == 0:
                        print(format_profile(prof, "fusion " + setting), flush=True)
    finally:
        runner.destroy()
        destroy_tensor_parallel()
    return results


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print(format_table(args, results))
    inactive = {r["fusion_reason_inactive"] for r in results if r["fusion"] != "off" and not r["fusion_active"]}
    for reason in inactive:
        print(f"note: fusion was requested but inactive: {reason}")
    if args.json_file:
        with open(args.json_file, "a") as f:
            f.write(json.dumps({"args": vars(args), "results": results}) + "\n")


def format_table(args: argparse.Namespace, results: list[dict[str, Any]]) -> str:
    """Prefill ms and TPOT ms per batch size and setting; TPOT and prefill gains against ``off``."""
    by = {(r["fusion"], r["batch_size"]): r for r in results}
    measured = [s for s in args.fusion]
    compared = [s for s in measured if s != "off"] if "off" in measured else []
    head = ([f"prefill {s}" for s in measured] + [f"TPOT {s}" for s in measured]
            + [f"TPOT gain {s}" for s in compared] + [f"prefill gain {s}" for s in compared])
    schedule = "no overlap" if args.disable_overlap_schedule else "overlap"
    lines = [f"model={args.model_path} tp={args.tp_size} input_len={args.input_len} output_len={args.output_len} "
             f"{schedule} (ms; gain = 1 - setting / off)",
             f"{'batch':>5} " + " ".join(f"{h:>17}" for h in head)]
    for bs in args.batch_size:
        def cell(setting: str, key: str) -> str:
            r = by.get((setting, bs))
            return f"{r[key]:.3f}" if r else "-"

        def gain(setting: str, key: str) -> str:
            off, r = by.get(("off", bs)), by.get((setting, bs))
            return f"{(1 - r[key] / off[key]) * 100:+.1f}%" if off and r else "-"

        cells = ([cell(s, "prefill_ms") for s in measured] + [cell(s, "tpot_ms") for s in measured]
                 + [gain(s, "tpot_ms") for s in compared] + [gain(s, "prefill_ms") for s in compared])
        lines.append(f"{bs:>5} " + " ".join(f"{c:>17}" for c in cells))
    return "\n".join(lines)


def _worker(rank: int, args: argparse.Namespace, init_method: str, queue: Any) -> None:
    try:
        queue.put((rank, run_rank(args, rank, init_method), None))
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

    from engine.launch_config import free_port

    args = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, init_method, queue)) for r in range(args.tp_size)]
    for p in procs:
        p.start()
    outcome = {}
    while len(outcome) < args.tp_size:
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
    report(args, outcome[0][0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
