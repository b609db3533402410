"""`python -m arfusion.engine.launch_server [options]`: start the TP workers and the HTTP server.

With no options it serves the built-in tiny model (dummy weights) on this machine's GPU, or on
the CPU when there is none. Node 0 runs TP rank 0 in this process (scheduler thread + HTTP
server) and spawns its other local ranks; other nodes (``--node-rank k``) only spawn theirs.

Start-up: node 0 binds the HTTP port first, so a taken port fails at once (exit code 2); it
listens, and logs "serving ... on http://...", only once the model is loaded and warm. Each
stage (file, tokenizer, config, TP group, weights, fusion setup, KV cache, graphs, warm-up,
step cost) logs its start and end on one clock from the process's start, and the serving line
sums them up (`engine.common.startup`); the model file is parsed once (`load_model_files`).
Every log line carries its time.
Until then a connection is refused. ``/health`` answers 503 naming the rank while a TP worker
misses its heartbeat (`engine.supervision.heartbeat`), and 200 again once it beats.

Shutdown: SIGTERM or SIGINT drains the server (`engine.server.http.server`): new requests get
503, the ones in flight get ``--shutdown-timeout`` seconds, the rest then end with an error;
the scheduler then tells the workers to shut down and every rank exits with 0.
Failure: a worker that exits, a scheduler step that fails, a worker whose heartbeat has been
missing for ``--dist-timeout`` (a stopped one) or a step in flight for longer than that (a
fused kernel waiting forever on a peer: `engine.supervision.watchdog`, a thread of its own that
needs neither the scheduler nor the GPU) brings the whole server down
(`engine.supervision.supervisor`): the log names the rank, every client in flight gets a 500 error,
every worker is killed (a stopped one, or one stuck in a kernel, too), and the exit code is 1.

Node 0's process is composed by `engine.server.rank0.Rank0Server` on TP rank 0's
`engine.runtime.rank_stack.RankStack`, which every TP worker builds the same way.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from arfusion.server_args import ServerArgs, ServerArgsError

if TYPE_CHECKING:
    from arfusion.engine.common.startup import StartupStages
    from arfusion.engine.runtime.launch import LaunchConfig
    from arfusion.engine.runtime.model_runner import StartupContext
    from arfusion.engine.supervision.workers import WorkerSet
    from arfusion.engine.tokenizers.tokenizer import Tokenizer

logger = logging.getLogger("arfusion.engine.launch_server")


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # a shutdown requested before the HTTP server runs is a clean exit


def load_model_files(args: ServerArgs, startup: "StartupContext") -> tuple["Tokenizer", "LaunchConfig"]:
    """Node 0's start-up before any rank, each part a stage of ``startup``: the model file parsed
    once ("file": ``startup.parsed``, which the tokenizer, the checks and rank 0's load share),
    the tokenizer ("tokenizer"), the launch config, and the checks every rank's load makes before
    it reads a tensor ("config")."""
    from arfusion.engine.launch_config import launch_config, with_tokenizer_vocab
    from arfusion.engine.models.builtin import BUILTIN_MODELS
    from arfusion.engine.runtime.model_runner import check_model_files
    from arfusion.engine.tokenizers.serving import check_paths_exist, load_serving_tokenizer
    from arfusion.engine.weights.loader import parse_model_file

    check_paths_exist(args.model_path, args.tokenizer_path)
    if args.model_path not in BUILTIN_MODELS:
        with startup.stages.stage("file"):
            startup.parsed = parse_model_file(args.model_path, args.load_format)
    with startup.stages.stage("tokenizer"):
        tokenizer = load_serving_tokenizer(args.model_path, args.tokenizer_path,
                                           None if args.tokenizer_path else startup.parsed)
    launch = with_tokenizer_vocab(launch_config(args), tokenizer.vocab_size)
    with startup.stages.stage("config"):
        check_model_files(launch.runner, startup.parsed)
    return tokenizer, launch


def serve(args: ServerArgs, stages: Optional["StartupStages"] = None) -> int:
    """Serve ``args`` (node 0) or run this node's workers; ``stages``: the process's start-up
    stages, begun at its start (default: from now)."""
    from arfusion.engine.common.startup import StartupStages
    from arfusion.engine.launch_config import launch_config, with_tokenizer_vocab
    from arfusion.engine.runtime.model_runner import StartupContext, check_model_files
    from arfusion.engine.supervision.workers import WorkerSet
    from arfusion.engine.tokenizers.serving import load_serving_tokenizer

    # SIGTERM unwinds like Ctrl-C until the HTTP server takes the signals over (it drains).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.node_rank != 0:
        launch = with_tokenizer_vocab(launch_config(args), load_serving_tokenizer(args.model_path, args.tokenizer_path).vocab_size)
        check_model_files(launch.runner)  # a file every rank would refuse is refused before any rank starts
        return _serve_other_node(WorkerSet(launch, list(launch.local_ranks)))
    from arfusion.engine.server.http.server import bind_http_socket
    from arfusion.engine.server.rank0 import Rank0Server

    with bind_http_socket(args.host, args.port) as sock:  # before the rendezvous port is chosen
        startup = StartupContext(stages or StartupStages(logger))
        tokenizer, launch = load_model_files(args, startup)
        return Rank0Server(args, launch, tokenizer, startup).serve(sock)


def _serve_other_node(workers: "WorkerSet") -> int:
    """A node other than 0 only runs its workers, until they exit; its exit code is theirs
    (0, or 2 when they refused the model with every rank), else 1."""
    from arfusion.engine.runtime.load_agreement import REFUSED_EXIT_CODE
    from arfusion.engine.supervision.workers import EXIT_GRACE_S

    try:
        while workers.alive():
            time.sleep(0.5)
    finally:
        codes = workers.stop(EXIT_GRACE_S)
    if all(code == 0 for code in codes.values()):
        return 0
    return REFUSED_EXIT_CODE if all(code == REFUSED_EXIT_CODE for code in codes.values()) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    started = time.perf_counter()  # the start-up stages' clock
    from arfusion.engine.common.startup import LOG_FORMAT, StartupStages

    try:
        args = ServerArgs.from_cli(argv, prog="python -m arfusion.engine.launch_server")
    except ServerArgsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT.format(rank=0))
    try:
        return serve(args, StartupStages(logger, origin=started))
    except ValueError as exc:  # a configuration that cannot run: say why, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
