"""`python -m engine.launch_server [options]`: start the TP workers and the HTTP server.

With no options it serves the built-in tiny model (dummy weights) on this machine's GPU, or on
the CPU when there is none. Node 0 runs TP rank 0 in this process (scheduler thread + HTTP
server) and spawns its other local ranks; other nodes (``--node-rank k``) only spawn theirs.

Failure handling: a worker that exits brings the whole server down with a message naming it
(no rank waits forever on a dead peer); SIGINT/SIGTERM stop the scheduler, which tells the
workers to shut down; workers that do not exit within a few seconds are killed.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence

from server_args import ServerArgs, ServerArgsError

logger = logging.getLogger("engine.launch_server")
WORKER_EXIT_GRACE_S = 5.0


class WorkerSet:
    """The spawned TP worker processes of this node, watched by a monitor thread."""

    def __init__(self, launch: Any, ranks: Sequence[int]) -> None:
        from engine.runtime.tp_worker import worker_main

        ctx = mp.get_context("spawn")
        self.procs = {r: ctx.Process(target=worker_main, args=(launch, r), name=f"tp-worker-{r}") for r in ranks}
        self.stopping = False
        for p in self.procs.values():
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs.values())

    def watch(self, on_death) -> threading.Thread:
        """Call ``on_death(rank, exitcode)`` (from a daemon thread) when a worker fails. A worker
        exits with 0 only after rank 0's "shutdown" plan, which is not a failure."""
        def loop() -> None:
            while not self.stopping:
                for rank, p in self.procs.items():
                    if not p.is_alive() and p.exitcode != 0 and not self.stopping:
                        on_death(rank, p.exitcode)
                        return
                time.sleep(0.2)

        thread = threading.Thread(target=loop, name="worker-monitor", daemon=True)
        thread.start()
        return thread

    def stop(self, grace_s: float = WORKER_EXIT_GRACE_S) -> None:
        self.stopping = True
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=2)


def _die_with_workers(workers: WorkerSet, reason: str) -> None:
    """Kill every worker and exit: a rank that stopped must not leave its peers waiting."""
    logger.error("%s: shutting the server down", reason)
    workers.stopping = True
    for p in workers.procs.values():
        if p.is_alive():
            p.kill()
    sys.stderr.flush()
    os._exit(1)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # a requested shutdown is a clean exit


def serve(args: ServerArgs) -> int:
    import torch
    import uvicorn

    from engine.server.engine import Engine
    from engine.launch_config import launch_config
    from engine.runtime.model_runner import ModelRunner
    from engine.scheduling.scheduler import Scheduler
    from engine.server.app import build_app
    from engine.tokenizers.serving import load_serving_tokenizer
    from layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    # SIGTERM unwinds like Ctrl-C, so the cleanup below runs (uvicorn re-raises the signal it
    # caught once it has stopped serving; the default action would kill us before cleanup).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    launch = launch_config(args)
    local = list(launch.local_ranks)
    workers = WorkerSet(launch, [r for r in local if r != 0])
    workers.watch(lambda rank, code: _die_with_workers(workers, f"TP worker rank {rank} exited (code {code})"))
    if args.node_rank != 0:
        try:
            while workers.alive():
                time.sleep(0.5)
        finally:
            workers.stop()
        return 0 if all(p.exitcode == 0 for p in workers.procs.values()) else 1

    torch.set_num_threads(launch.threads_per_rank)
    runner = scheduler = scheduler_thread = None
    try:
        tokenizer = load_serving_tokenizer(args.model_path, args.tokenizer_path)
        group = init_tensor_parallel(launch.tp_size, 0, launch.init_method, device=launch.device_for(0),
                                     node_rank=args.node_rank, timeout_s=launch.dist_timeout)
        runner = ModelRunner(launch.runner, group)
        scheduler = Scheduler(runner, tokenizer, args.max_prefill_tokens, args.seed,
                              on_failure=lambda why: _die_with_workers(workers, f"the scheduler failed ({why})"),
                              overlap=not args.disable_overlap_schedule)
        model_name = args.served_model_name or args.model_path

        def info() -> dict[str, Any]:
            return {
                "server_args": args.model_dump(),
                "model": {"name": model_name, "context_length": runner.context_len,
                          "num_layers": runner.config.num_hidden_layers, "hidden_size": runner.config.hidden_size},
                "device": str(runner.device), "dtype": str(runner.dtype), "tp_size": group.world_size,
                "tp_spans_nodes": group.spans_nodes, "kv_cache_slots": runner.num_kv_slots,
                "cuda_graph_batch_sizes": runner.graphs.sizes if runner.graphs else [],
                "fusion": runner.fusion.status(), "load": scheduler.load(),
            }

        engine = Engine(scheduler, tokenizer, model_name, info, workers.alive)
        scheduler_thread = threading.Thread(target=scheduler.run_forever, name="scheduler", daemon=True)
        scheduler_thread.start()
        app = build_app(engine, model_name)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=3)
        logger.info("serving %s on http://%s:%d (TP %d, fusion: %s)", model_name, args.host, args.port,
                    group.world_size, "active" if runner.fusion.active else runner.fusion.status()["reason_inactive"])
        uvicorn.Server(config).run()
    finally:
        if scheduler is not None:
            scheduler.stop()  # its thread finishes the step in flight, then broadcasts "shutdown"
        if scheduler_thread is not None:
            scheduler_thread.join(timeout=WORKER_EXIT_GRACE_S)
        workers.stop()
        if runner is not None:
            runner.destroy()
        destroy_tensor_parallel()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = ServerArgs.from_cli(argv, prog="python -m engine.launch_server")
    except ServerArgsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="[tp0] %(levelname)s %(name)s: %(message)s")
    try:
        return serve(args)
    except ValueError as exc:  # a configuration that cannot run: say why, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
