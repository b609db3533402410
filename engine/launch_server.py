"""`python -m engine.launch_server [options]`: start the TP workers and the HTTP server.

With no options it serves the built-in tiny model (dummy weights) on this machine's GPU, or on
the CPU when there is none. Node 0 runs TP rank 0 in this process (scheduler thread + HTTP
server) and spawns its other local ranks; other nodes (``--node-rank k``) only spawn theirs.

Start-up: node 0 binds the HTTP port first, so a taken port fails at once (exit code 2); it
listens, and logs "serving ... on http://...", only once the model is loaded and warm.
Until then a connection is refused. ``/health`` answers 503 naming the rank while a TP worker
misses its heartbeat (`engine.runtime.heartbeat`), and 200 again once it beats.

Shutdown: SIGTERM or SIGINT drains the server (`engine.server.http.server`): new requests get
503, the ones in flight get ``--shutdown-timeout`` seconds, the rest then end with an error;
the scheduler then tells the workers to shut down and every rank exits with 0.
Failure: a worker that exits, a scheduler step that fails, a worker whose heartbeat has been
missing for ``--dist-timeout`` (a stopped one) or a step in flight for longer than that (a
fused kernel waiting forever on a peer: `engine.runtime.watchdog`, a thread of its own that
needs neither the scheduler nor the GPU) brings the whole server down
(`engine.runtime.supervisor`): the log names the rank, every client in flight gets a 500 error,
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

from server_args import ServerArgs, ServerArgsError

if TYPE_CHECKING:
    from engine.runtime.workers import WorkerSet


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # a shutdown requested before the HTTP server runs is a clean exit


def serve(args: ServerArgs) -> int:
    from engine.launch_config import launch_config, with_tokenizer_vocab
    from engine.runtime.model_runner import check_model_files
    from engine.runtime.workers import WorkerSet
    from engine.tokenizers.serving import load_serving_tokenizer

    # SIGTERM unwinds like Ctrl-C until the HTTP server takes the signals over (it drains).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.node_rank != 0:
        launch = with_tokenizer_vocab(launch_config(args), load_serving_tokenizer(args.model_path, args.tokenizer_path).vocab_size)
        check_model_files(launch.runner)  # a file every rank would refuse is refused before any rank starts
        return _serve_other_node(WorkerSet(launch, list(launch.local_ranks)))
    from engine.server.http.server import bind_http_socket
    from engine.server.rank0 import Rank0Server

    with bind_http_socket(args.host, args.port) as sock:  # before the rendezvous port is chosen
        tokenizer = load_serving_tokenizer(args.model_path, args.tokenizer_path)
        launch = with_tokenizer_vocab(launch_config(args), tokenizer.vocab_size)
        check_model_files(launch.runner)
        return Rank0Server(args, launch, tokenizer).serve(sock)


def _serve_other_node(workers: "WorkerSet") -> int:
    """A node other than 0 only runs its workers, until they exit; its exit code is theirs
    (0, or 2 when they refused the model with every rank), else 1."""
    from engine.runtime.load_agreement import REFUSED_EXIT_CODE
    from engine.runtime.workers import EXIT_GRACE_S

    try:
        while workers.alive():
            time.sleep(0.5)
    finally:
        codes = workers.stop(EXIT_GRACE_S)
    if all(code == 0 for code in codes.values()):
        return 0
    return REFUSED_EXIT_CODE if all(code == REFUSED_EXIT_CODE for code in codes.values()) else 1


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
