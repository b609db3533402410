"""`python -m engine.launch_server [options]`: start the TP workers and the HTTP server.

With no options it serves the built-in tiny model (dummy weights) on this machine's GPU, or on
the CPU when there is none. Node 0 runs TP rank 0 in this process (scheduler thread + HTTP
server) and spawns its other local ranks; other nodes (``--node-rank k``) only spawn theirs.

Start-up: node 0 binds the HTTP port first, so a taken port fails at once (exit code 2); it
listens, and logs "serving ... on http://...", only once the model is loaded and warm.
Until then a connection is refused. ``/health`` answers 503 naming the rank while a TP worker
misses its heartbeat (`engine.runtime.heartbeat`), and 200 again once it beats.

Shutdown: SIGTERM or SIGINT drains the server (`engine.server.http_server`): new requests get
503, the ones in flight get ``--shutdown-timeout`` seconds, the rest then end with an error;
the scheduler then tells the workers to shut down and every rank exits with 0.
Failure: a worker that exits, a scheduler step that fails, a worker whose heartbeat has been
missing for ``--dist-timeout`` (a stopped one) or a step in flight for longer than that (a
fused kernel waiting forever on a peer: `engine.runtime.watchdog`, a thread of its own that
needs neither the scheduler nor the GPU) brings the whole server down
(`engine.server.supervisor`): the log names the rank, every client in flight gets a 500 error,
every worker is killed (a stopped one, or one stuck in a kernel, too), and the exit code is 1.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence

from server_args import ServerArgs, ServerArgsError

logger = logging.getLogger("engine.launch_server")
WORKER_EXIT_GRACE_S = 5.0


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # a shutdown requested before the HTTP server runs is a clean exit


def startup_summary(seconds: dict[str, float]) -> str:
    """The start-up part of the startup line: the runner's phases (``startup_s``: weights,
    fusion setup, KV cache, graphs, warm-up) and their sum."""
    phases = ", ".join(f"{phase} {s:.1f} s" for phase, s in seconds.items())
    return f"start-up {sum(seconds.values()):.1f} s: {phases}"


def fusion_summary(status: dict[str, Any]) -> str:
    """The fusion part of the startup line, from the fusion op's status dict."""
    return "all-reduce fusion active" if status["active"] else f"all-reduce unfused: {status['reason_inactive']}"


def serve(args: ServerArgs) -> int:
    import torch

    from engine.launch_config import launch_config
    from engine.runtime.model_runner import check_model_files
    from engine.server.workers import WorkerSet
    from engine.tokenizers.serving import load_serving_tokenizer

    # SIGTERM unwinds like Ctrl-C until the HTTP server takes the signals over (it drains).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.node_rank != 0:
        launch = launch_config(args)
        check_model_files(launch.runner)  # a file every rank would refuse is refused before any rank starts
        return _serve_other_node(WorkerSet(launch, list(launch.local_ranks)))
    from engine.server.http_server import bind_http_socket
    from engine.server.supervisor import Supervisor

    with bind_http_socket(args.host, args.port) as sock:  # before the rendezvous port is chosen
        launch = launch_config(args)
        tokenizer = load_serving_tokenizer(args.model_path, args.tokenizer_path)
        check_model_files(launch.runner)
        workers = WorkerSet(launch, [r for r in launch.local_ranks if r != 0])
        supervisor = Supervisor(workers)
        workers.watch(supervisor.fail)
        torch.set_num_threads(launch.threads_per_rank)
        return _serve_rank0(args, launch, tokenizer, supervisor, sock)


def _serve_other_node(workers: Any) -> int:
    """A node other than 0 only runs its workers, until they exit; its exit code is theirs
    (0, or 2 when they refused the model with every rank), else 1."""
    from engine.runtime.load_agreement import REFUSED_EXIT_CODE

    try:
        while workers.alive():
            time.sleep(0.5)
    finally:
        codes = workers.stop(WORKER_EXIT_GRACE_S)
    if all(code == 0 for code in codes.values()):
        return 0
    return REFUSED_EXIT_CODE if all(code == REFUSED_EXIT_CODE for code in codes.values()) else 1


def _serve_rank0(args: ServerArgs, launch: Any, tokenizer: Any, supervisor: Any, sock: Any) -> int:
    """Rank 0's model and scheduler, and the HTTP server on the bound socket ``sock`` until it
    has drained; then every rank shuts down."""
    from engine.common.generation import EngineError
    from engine.runtime.heartbeat import HeartbeatMonitor
    from engine.runtime.watchdog import DistWatchdog
    from engine.runtime.model_runner import ModelRunner
    from engine.runtime.step_cost import measure_step_cost
    from engine.runtime.warm_up import warm_up
    from engine.scheduling.scheduler import Scheduler
    from engine.server.app import build_app
    from engine.server.engine import Engine
    from engine.server.http_limits import max_request_bytes
    from engine.server.http_server import DrainingServer, HttpLimits, http_config
    from engine.server.lifecycle import Lifecycle
    from layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    runner = scheduler = scheduler_thread = heartbeats = watchdog = None
    try:
        group = init_tensor_parallel(launch.tp_size, 0, launch.init_method, device=launch.device_for(0),
                                     node_rank=args.node_rank, timeout_s=launch.dist_timeout)
        if launch.tp_size > 1:
            heartbeats = HeartbeatMonitor(launch.init_method, range(1, launch.tp_size), launch.dist_timeout)
            watchdog = DistWatchdog(heartbeats, launch.dist_timeout, supervisor.fail)
        runner = ModelRunner(launch.runner, group)
        if watchdog is not None:
            watchdog.watch_steps(runner.progress)
        scheduler = Scheduler(runner, tokenizer, args.max_prefill_tokens, args.seed,
                              on_failure=lambda why: supervisor.fail(f"the scheduler failed: {why}"),
                              overlap=not args.disable_overlap_schedule, heartbeat_s=args.dist_timeout / 4,
                              chunked_prefill_size=args.chunked_prefill_size,
                              step_time_target_s=args.step_time_target_ms / 1000)
        if not args.skip_server_warmup:
            warm_up(runner, scheduler.policy.max_extend_tokens)  # before the scheduler's first plan and before /health
        budget = scheduler.policy.budget
        if budget is not None and budget.target_s:  # the step cost, measured once warm
            cost = measure_step_cost(runner, budget.max_tokens, budget.target_s)
            budget.start_from(cost)
            logger.info("step cost %.1f ms + %.3f ms per token: %d prompt tokens per step (target %g ms)",
                        cost.fixed_s * 1e3, cost.per_token_s * 1e3, budget.prompt_tokens(0), args.step_time_target_ms)
        model_name = args.served_model_name or args.model_path
        body_limit = max_request_bytes(args.max_request_bytes, runner.context_len)

        def info() -> dict[str, Any]:
            fusion = runner.fusion.status()
            return {
                "server_args": args.model_dump(),
                "model": {"name": model_name, "context_length": runner.context_len,
                          "num_layers": runner.config.num_hidden_layers, "hidden_size": runner.config.hidden_size},
                "device": str(runner.device), "dtype": str(runner.dtype), "tp_size": group.world_size,
                "tp_spans_nodes": group.spans_nodes, "tp_shared_gpu": group.shared_gpu_note,
                "kv_cache_slots": runner.num_kv_slots,
                "cuda_graph_batch_sizes": runner.graphs.sizes if runner.graphs else [],
                "fusion": fusion, "load": scheduler.load(), "max_request_bytes": body_limit,
                # batch-invariant mode, and the fused strategies the dispatch may pick in it
                "deterministic": runner.deterministic,
                "deterministic_strategies": fusion.get("deterministic_strategies", []) if runner.deterministic else [],
            }

        engine = Engine(scheduler, tokenizer, model_name, info, supervisor.workers.alive,
                        heartbeats.missed if heartbeats is not None else lambda: None)
        lifecycle = Lifecycle()
        supervisor.serving(engine, lifecycle)
        scheduler_thread = threading.Thread(target=scheduler.run_forever, name="scheduler", daemon=True)
        scheduler_thread.start()
        shutdown = EngineError(503, f"the server shut down before the request finished "
                                    f"(--shutdown-timeout {args.shutdown_timeout:g} s)")
        limits = HttpLimits(body_limit, args.request_head_timeout, args.request_body_timeout, args.max_connections)
        config = http_config(build_app(engine, model_name, lifecycle), limits, args.log_level)

        def serving() -> None:
            logger.info("serving %s on http://%s:%d (TP %d, %s; %s)", model_name, args.host, args.port,
                        group.world_size, fusion_summary(runner.fusion.status())
                        + ("; deterministic (batch-invariant)" if runner.deterministic else ""),
                        startup_summary(runner.startup_s))

        DrainingServer(config, lifecycle, args.shutdown_timeout, lambda: engine.fail_all(shutdown), serving).run([sock])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the clean-up below is bounded: let it finish
            signal.signal(sig, signal.SIG_IGN)
        if watchdog is not None:
            watchdog.stop()  # a clean shutdown from here on: no step or beat is due any more
        if scheduler is not None:
            scheduler.stop()  # its thread finishes the step in flight, then broadcasts "shutdown"
        if scheduler_thread is not None:
            scheduler_thread.join(timeout=WORKER_EXIT_GRACE_S)
        codes = supervisor.workers.stop(WORKER_EXIT_GRACE_S)
        if codes:
            logger.info("TP workers exited: %s", ", ".join(f"rank {r} with code {c}" for r, c in codes.items()))
        if heartbeats is not None:
            heartbeats.stop()
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
