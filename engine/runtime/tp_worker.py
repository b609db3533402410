"""TP ranks other than 0: run whatever `StepPlan` rank 0 broadcasts, until "shutdown" ("idle"
plans only keep the wait for the next plan within ``--dist-timeout``). Each beats its heartbeat
(`engine.runtime.heartbeat`) from the moment it joined the group, and publishes beside it the
last step it finished on its device, once its runner exists."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch

from engine.runtime.heartbeat import Heartbeat
from engine.runtime.launch import LaunchConfig
from engine.runtime.load_agreement import REFUSED_EXIT_CODE, LoadRefused
from engine.runtime.model_runner import ModelRunner
from layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

logger = logging.getLogger(__name__)


def _exit_when_parent_dies(poll_s: float = 0.5) -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(launch: LaunchConfig, rank: int) -> None:
    """Entry point of a spawned TP worker process (exits the process)."""
    logging.basicConfig(level=launch.log_level.upper(), format=f"[tp{rank}] %(levelname)s %(name)s: %(message)s")
    # The launcher decides when workers stop (a terminal's Ctrl-C or a group-wide SIGTERM reaches
    # every process); if the launcher itself dies, exit instead of waiting on a dead rank 0.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_when_parent_dies()
    runner = heartbeat = None
    code = 0
    try:
        torch.set_num_threads(max(1, launch.threads_per_rank))
        group = init_tensor_parallel(launch.tp_size, rank, launch.init_method, device=launch.device_for(rank),
                                     node_rank=launch.node_rank, timeout_s=launch.dist_timeout)
        heartbeat = Heartbeat(launch.init_method, rank, launch.dist_timeout)
        runner = ModelRunner(launch.runner, group)
        heartbeat.publish_steps(runner.progress)  # rank 0's watchdog names the ranks behind a stalled step
        while True:
            plan = group.broadcast_object(None, src=0)
            if plan.kind == "shutdown":
                break
            if plan.kind == "idle":
                continue
            runner.forward(plan)
            runner.commit_tokens(None)  # rank 0's sampled tokens, into this rank's table
    except LoadRefused:
        code = REFUSED_EXIT_CODE  # every rank refused the model: rank 0 says why
    except Exception:
        logger.exception("TP worker rank %d failed", rank)
        code = 1
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if runner is not None:
            runner.destroy()
        try:
            destroy_tensor_parallel()
        except Exception:
            code = code or 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: NCCL/IPC destructors can hang at exit
