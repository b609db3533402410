"""`RankStack`: one TP rank's parts, built by `build_rank` in the one order every process of a
launch uses (rank 0 in the launcher, each TP worker, each rank of `engine.bench_one_batch`), so
that no two processes can disagree on it:

    threads    torch's CPU threads for this rank (``LaunchConfig.threads_per_rank``)
    group      the TP process group (`layers.parallel_state.init_tensor_parallel`): the
               rendezvous, with ``--dist-timeout``
    watch      what watches this rank (`StepWatch`, made by the caller's ``watch()``), or
               `Unwatched`
    fusion op  inside one load agreement the fusion op, then
    model      the model built on it with its weights, then the op's workspace (before any
               graph capture)
    KV cache   from the memory left, agreed by every rank
    graphs     the decode CUDA graphs; the `ModelRunner` runs steps over these parts
               (`engine.runtime.rank_parts` builds each)

Every part registers its teardown on the caller's `contextlib.ExitStack` as it is built, so
that closing the stack tears down in reverse: the graphs, ``peers_done()`` (rank 0: its local
workers have exited, so no peer still maps this rank's fused workspace) then the fusion op, the
watch, the process group last. A part that fails to build tears down exactly the ones before it
(``peers_done()`` included, once, also when the op was never built).
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from arfusion.engine.runtime.launch import LaunchConfig
from arfusion.engine.runtime.model_runner import ModelRunner, RunnerSettings, StartupContext
from arfusion.engine.runtime.rank_parts import enter_group, enter_runner
from arfusion.engine.runtime.step_progress import StepProgress
from arfusion.fusion import AllReduceFusion, TensorParallelGroup


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
        """The model's fusion op (built with the model, before it)."""
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
        group = enter_group(stack, launch.tp_size, rank, launch.init_method, launch.device_for(rank),
                            launch.node_rank, launch.dist_timeout)
    watching = watch()
    stack.callback(watching.stop)
    once = _Once(peers_done)
    stack.callback(once)
    runner = enter_runner(stack, settings or launch.runner, group, once, startup)
    watching.watch_steps(runner.progress)
    return RankStack(launch, rank, group, watching, runner)


class _Once:
    """Calls ``action`` on its first call only (``peers_done``: before the op's destroy, or on
    its own when the rank failed before its op existed)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self._action: Optional[Callable[[], None]] = action

    def __call__(self) -> None:
        action, self._action = self._action, None
        if action is not None:
            action()
