"""`Rank0Server`: node 0's process, composed in one place. It spawns the node's other TP ranks
(`engine.supervision.workers.WorkerSet`, watched by the `Supervisor`), builds TP rank 0's
`RankStack` (group, watch, fusion op and model in the runner: the order every worker uses), then
the serving parts on top of it, in order:

    scheduler  the `Scheduler` over the runner; warm-up (before its first plan and before
               /health), then the step cost of the step-time budget, measured once warm
    engine     the `Engine` the routes talk to, given the model's context and fusion op
    app        the API (`engine.server.api.build_app`) behind the HTTP limits, on the bound socket;
               large bodies screened first by the API's own validation in parser processes
               (`engine.server.api.body_screen`, `engine.server.http.parser_pool`)
    http       the `DrainingServer`; the scheduler thread starts just before it serves; it starts
               the parser processes before it listens and stops them when it stops serving

Every part's teardown goes on one `contextlib.ExitStack` as it is built. On the way out (a
drained server, or a part that failed to build) the signals are ignored (the clean-up is
bounded: let it finish) and the ``--dist-timeout`` watchdog stops (a clean shutdown: no step or
beat is due any more); then the stack unwinds in reverse: the scheduler finishes its step in
flight and broadcasts "shutdown", the workers exit (or are killed after a grace period), then the
runner, the watch and the process group go.
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Optional

from arfusion.engine.common.generation import EngineError, TokenizerLike
from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.model_runner import StartupContext
from arfusion.engine.runtime.rank_stack import RankStack, StepWatch, Unwatched, build_rank
from arfusion.engine.runtime.step_cost import measure_step_cost
from arfusion.engine.runtime.warm_up import warm_up
from arfusion.engine.scheduling.scheduler import Scheduler, idle_plan_interval_s
from arfusion.engine.server.api import build_app
from arfusion.engine.server.api.body_screen import build_screen
from arfusion.engine.server.engine import Engine
from arfusion.engine.server.http.lifecycle import Lifecycle
from arfusion.engine.server.http.limits import max_request_bytes
from arfusion.engine.server.http.parser_pool import ParserPool
from arfusion.engine.server.http.server import BodyParsing, DrainingServer, HttpLimits, http_config
from arfusion.engine.supervision.supervisor import Supervisor
from arfusion.engine.supervision.watchdog import GroupWatch
from arfusion.engine.supervision.workers import EXIT_GRACE_S, WorkerSet
from arfusion.server_args import ServerArgs

logger = logging.getLogger("arfusion.engine.launch_server")


def fusion_summary(status: dict[str, Any]) -> str:
    """The fusion part of the startup line, from the fusion op's status dict."""
    return "all-reduce fusion active" if status["active"] else f"all-reduce unfused: {status['reason_inactive']}"


@dataclass(frozen=True)
class ServingParts:
    """Rank 0's serving parts on top of its `RankStack`, in the order they were built."""

    rank: RankStack
    scheduler: Scheduler
    engine: Engine
    lifecycle: Lifecycle
    http: DrainingServer


class Rank0Server:
    """Node 0's TP workers and rank 0 with the HTTP server (the module docstring)."""

    def __init__(self, args: ServerArgs, launch: LaunchConfig, tokenizer: TokenizerLike,
                 startup: Optional[StartupContext] = None) -> None:
        """``startup``: the launcher's start-up stages (rank 0's continue them) and the model file
        it parsed (rank 0 loads from it)."""
        self.args = args
        self.launch = launch
        self.tokenizer = tokenizer
        self.startup = startup or StartupContext()
        self.model_name = args.served_model_name or args.model_path
        self._watch: Optional[GroupWatch] = None
        self._workers_ended = False

    def serve(self, sock: socket.socket) -> int:
        """Build every part, serve on the bound socket ``sock`` until the server has drained, then
        tear down in reverse (every rank exits). Returns the exit code (0)."""
        with ExitStack() as stack:
            try:
                self.build(stack).http.run([sock])
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):  # the clean-up below is bounded: let it finish
                    signal.signal(sig, signal.SIG_IGN)
                if self._watch is not None:
                    self._watch.quiesce()
        return 0

    def build(self, stack: ExitStack) -> ServingParts:
        """Every part, in order, each with its teardown on ``stack``."""
        launch, args = self.launch, self.args
        self.workers = WorkerSet(launch, [r for r in launch.local_ranks if r != 0])
        stack.callback(self._end_workers)  # also when rank 0's group or model fails to build
        self.supervisor = Supervisor(self.workers)
        self.workers.watch(self.supervisor.fail)
        rank = build_rank(stack, launch, 0, watch=self._make_watch, peers_done=self._end_workers, startup=self.startup)
        self.startup.parsed = None  # loaded: the model file's maps can go
        scheduler = self._scheduler(rank)
        body_limit = max_request_bytes(args.max_request_bytes, rank.runner.context_len)
        engine = Engine(scheduler, self.tokenizer, self.model_name, rank.runner.context_len,
                        rank.runner.clear_fusion_cache, lambda: self._info(rank, scheduler, body_limit), self.workers.alive,
                        self._watch.missed if self._watch is not None else lambda: None)
        lifecycle = Lifecycle()
        self.supervisor.serving(engine.fail_all, lambda: lifecycle.in_flight)
        thread = threading.Thread(target=scheduler.run_forever, name="scheduler", daemon=True)
        thread.start()
        stack.callback(self._stop_scheduler, scheduler, thread)
        shutdown = EngineError(503, f"the server shut down before the request finished "
                                    f"(--shutdown-timeout {args.shutdown_timeout:g} s)")
        limits = HttpLimits(body_limit, args.request_head_timeout, args.request_body_timeout, args.max_connections)
        app = build_app(engine, self.model_name, lifecycle, args.allow_special_tokens_in_messages)
        pool = ParserPool(build_screen, args.body_parsers, args.body_parser_queue) if args.body_parsers else None
        parsing = BodyParsing(pool, args.body_parser_min_bytes) if pool is not None else None
        config = http_config(app, limits, args.log_level, parsing)
        http = DrainingServer(config, lifecycle, args.shutdown_timeout, lambda: engine.fail_all(shutdown),
                              lambda: self._log_serving(rank), pool)
        return ServingParts(rank, scheduler, engine, lifecycle, http)

    def _make_watch(self) -> StepWatch:
        """Rank 0's watch over a group of more than one rank (kept for /health and the quiesce)."""
        if self.launch.tp_size == 1:
            return Unwatched()
        self._watch = GroupWatch(self.launch.init_method, self.launch.tp_size, self.launch.dist_timeout,
                                 self.supervisor.fail)
        return self._watch

    def _scheduler(self, rank: RankStack) -> Scheduler:
        """The scheduler over the warm runner, its step-time budget started from the measured step cost."""
        args = self.args
        scheduler = Scheduler(rank.runner, self.tokenizer, args.max_prefill_tokens, args.seed,
                              on_failure=lambda why: self.supervisor.fail(f"the scheduler failed: {why}",
                                                                          scheduler.failure_traceback),
                              overlap=not args.disable_overlap_schedule, heartbeat_s=idle_plan_interval_s(args.dist_timeout),
                              chunked_prefill_size=args.chunked_prefill_size,
                              step_time_target_s=args.step_time_target_ms / 1000)
        if not args.skip_server_warmup:
            warm_up(rank.runner, scheduler.policy.max_extend_tokens)  # before the scheduler's first plan and before /health
        budget = scheduler.policy.budget
        if budget is not None and budget.target_s:  # the step cost, measured once warm
            with rank.runner.stages.stage("step cost", rank.runner.synchronize):
                cost = measure_step_cost(rank.runner, budget.max_tokens, budget.target_s)
            budget.start_from(cost)
            logger.info("step cost %.1f ms + %.3f ms per token: %d prompt tokens per step (target %g ms)",
                        cost.fixed_s * 1e3, cost.per_token_s * 1e3, budget.prompt_tokens(0), args.step_time_target_ms)
        return scheduler

    def _info(self, rank: RankStack, scheduler: Scheduler, body_limit: int) -> dict[str, Any]:
        """/get_server_info's answer."""
        runner, group, fusion = rank.runner, rank.group, rank.fusion.status()
        return {
            "server_args": self.args.model_dump(),
            "model": {"name": self.model_name, "context_length": runner.context_len,
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

    def _log_serving(self, rank: RankStack) -> None:
        """The startup line, once the socket accepts requests."""
        logger.info("serving %s on http://%s:%d (TP %d, %s; %s)", self.model_name, self.args.host, self.args.port,
                    rank.group.world_size, fusion_summary(rank.fusion.status())
                    + ("; deterministic (batch-invariant)" if rank.runner.deterministic else ""),
                    self.startup.stages.summary())

    @staticmethod
    def _stop_scheduler(scheduler: Scheduler, thread: threading.Thread) -> None:
        scheduler.stop()  # its thread finishes the step in flight, then broadcasts "shutdown"
        thread.join(timeout=EXIT_GRACE_S)

    def _end_workers(self) -> None:
        """Wait for the workers to exit (after "shutdown"), killing the rest after the grace
        period; once, whichever teardown comes first."""
        if self._workers_ended:
            return
        self._workers_ended = True
        codes = self.workers.stop(EXIT_GRACE_S)
        if codes:
            logger.info("TP workers exited: %s", ", ".join(f"rank {r} with code {c}" for r, c in codes.items()))
