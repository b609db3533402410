"""A TP worker process (a rank other than 0): its `RankStack`, watched by its `Heartbeat`, runs
every `StepPlan` rank 0 broadcasts until "shutdown" ("idle" plans are skipped)."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from contextlib import ExitStack

from arfusion.engine.common.startup import LOG_FORMAT
from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.load_agreement import REFUSED_EXIT_CODE, LoadRefused
from arfusion.engine.runtime.rank_stack import RankStack, build_rank
from arfusion.engine.supervision.heartbeat import Heartbeat

logger = logging.getLogger(__name__)


def _exit_when_parent_dies(poll_s: float = 0.5) -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def follow_plans(rank: RankStack) -> None:
    """Run every plan rank 0 broadcasts until its "shutdown"."""
    while True:
        plan = rank.group.broadcast_object(None, src=0)
        if plan.kind == "shutdown":
            return
        if plan.kind == "idle":
            continue
        rank.runner.forward(plan)
        rank.runner.commit_tokens(None)  # rank 0's sampled tokens, into this rank's table


def worker_main(launch: LaunchConfig, rank: int) -> None:
    """Entry point of a spawned TP worker process: build rank ``rank``'s `RankStack` with its
    `Heartbeat`, follow rank 0's plans, tear the stack down in reverse, and exit the process
    with 0, `REFUSED_EXIT_CODE` (every rank refused the model) or 1 (anything else failed)."""
    logging.basicConfig(level=launch.log_level.upper(), format=LOG_FORMAT.format(rank=rank))
    # The launcher decides when workers stop (a terminal's Ctrl-C or a group-wide SIGTERM reaches
    # every process); if the launcher itself dies, exit instead of waiting on a dead rank 0.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_when_parent_dies()
    code = 0
    try:
        with ExitStack() as stack:
            try:
                follow_plans(build_rank(stack, launch, rank,
                                        watch=lambda: Heartbeat(launch.init_method, rank, launch.dist_timeout)))
            except LoadRefused:
                code = REFUSED_EXIT_CODE  # every rank refused the model: rank 0 says why
            except Exception:
                logger.exception("TP worker rank %d failed", rank)  # before the teardown, which may hang
                code = 1
    except Exception:
        code = code or 1  # the teardown failed
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: NCCL/IPC destructors can hang at exit
