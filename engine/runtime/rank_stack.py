"""`RankStack`: one TP rank's parts, built by `build_rank` in the one order every process of a
launch uses (rank 0 in the launcher, each TP worker, each rank of `engine.bench_one_batch`), so
that no two processes can disagree on it:

    threads    torch's CPU threads for this rank (``LaunchConfig.threads_per_rank``)
    group      the TP process group (`layers.parallel_state.init_tensor_parallel`): the
               rendezvous, with ``--dist-timeout``
    watch      what watches this rank (`StepWatch`): a worker's `Heartbeat`, rank 0's
               `GroupWatch` (heartbeat monitor and ``--dist-timeout`` watchdog), or `Unwatched`
    runner     the `ModelRunner`: inside one load agreement the fusion op and the model built on
               it with its weights, then the op's workspace (before any graph capture), the KV
               cache and the decode CUDA graphs (`engine.runtime.model_runner`)

Every part registers its teardown on the caller's `contextlib.ExitStack` as it is built, so
that closing the stack tears down in reverse: ``peers_done()`` (rank 0: its local workers have
exited, so no peer still maps this rank's fused workspace), the runner (graphs, then the fusion
op), the watch, the process group last. A part that fails to build tears down the ones before it.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch

from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.model_runner import ModelRunner, RunnerSettings, StartupContext
from arfusion.engine.runtime.step_progress import StepProgress
from arfusion.fusion import AllReduceFusion, TensorParallelGroup
from arfusion.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel


class StepWatch(Protocol):
    """What watches a rank while it runs: started before the runner (a rank that stops while the
    model loads is seen too), given the runner's steps once it exists, stopped before the group."""

    def watch_steps(self, progress: StepProgress) -> None: ...

    def stop(self) -> None: ...


class Unwatched:
    """The `StepWatch` of a rank no one watches (TP 1, a benchmark's ranks)."""

    def watch_steps(self, progress: StepProgress) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class RankStack:
    """One TP rank's parts, in the order they were built (the module docstring)."""

    launch: LaunchConfig
    rank: int
    group: TensorParallelGroup
    watch: StepWatch
    runner: ModelRunner

    @property
    def fusion(self) -> AllReduceFusion:
        """The model's fusion op (built by the runner with the model, before it)."""
        return self.runner.fusion


def build_rank(stack: ExitStack, launch: LaunchConfig, rank: int, watch: Callable[[], StepWatch] = Unwatched,
               settings: Optional[RunnerSettings] = None, peers_done: Callable[[], None] = lambda: None,
               startup: Optional[StartupContext] = None) -> RankStack:
    """Build rank ``rank``'s parts, registering their teardown on ``stack``: ``watch()`` makes
    its watch once the group exists; ``settings`` (default ``launch.runner``) configure its
    runner; ``peers_done()`` runs before the runner is torn down (or after it failed to build);
    ``startup``: the process's start-up stages (the rendezvous is the stage "TP group") and the
    model file it parsed already."""
    torch.set_num_threads(max(1, launch.threads_per_rank))
    startup = startup or StartupContext()
    with startup.stages.stage("TP group"):
        group = init_tensor_parallel(launch.tp_size, rank, launch.init_method, device=launch.device_for(rank),
                                     node_rank=launch.node_rank, timeout_s=launch.dist_timeout)
    stack.callback(destroy_tensor_parallel)
    watching = watch()
    stack.callback(watching.stop)
    runner = stack.enter_context(_runner(settings or launch.runner, group, peers_done, startup))
    watching.watch_steps(runner.progress)
    return RankStack(launch, rank, group, watching, runner)


@contextmanager
def _runner(settings: RunnerSettings, group: TensorParallelGroup, peers_done: Callable[[], None],
            startup: StartupContext) -> Iterator[ModelRunner]:
    """The rank's `ModelRunner`; on exit ``peers_done()``, then the runner's teardown."""
    runner: Optional[ModelRunner] = None
    try:
        runner = ModelRunner(settings, group, startup)
        yield runner
    finally:
        peers_done()
        if runner is not None:
            runner.destroy()
