"""Run one worker function per rank in spawned processes, with a hard timeout.

Each rank joins a TP group over gloo (CPU) or NCCL (GPU) on a free localhost port, runs
``worker(rank, world_size, *args)`` and reports its return value or its traceback. A rank
that does not report within ``timeout_s`` (after `STARTUP_ALLOWANCE_S` for spawning the ranks)
fails the test, and every rank is killed.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

# Spawning the ranks, importing torch and joining the group, before the ``timeout_s`` of the work
# starts: seconds when idle, much longer on a loaded machine, never a sign of a hang.
STARTUP_ALLOWANCE_S = 120.0


def gpu_world_size() -> int:
    """Ranks of the GPU tests: ``ARFUSION_GPU_WORLD`` (default 2; 4 or 8 on bigger machines)."""
    return int(os.environ.get("ARFUSION_GPU_WORLD", "2"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(worker: Callable[..., Any], rank: int, world_size: int, port: int, device_kind: str,
                results: Any, args: tuple, node_ranks: list[int] | None) -> None:
    from arfusion.layers.parallel_state import (
        destroy_tensor_parallel,
        init_tensor_parallel,
    )

    torch.set_num_threads(1)
    try:
        # more ranks than GPUs share them (the TP group detects it: shared-GPU mode)
        device = torch.device("cuda", rank % torch.cuda.device_count()) if device_kind == "cuda" else torch.device("cpu")
        node_rank = node_ranks[rank] if node_ranks else 0
        init_tensor_parallel(world_size, rank, f"tcp://127.0.0.1:{port}", device=device, node_rank=node_rank, timeout_s=60)
        # Plain pickle (tensor data copied, not shared through fds that die with this process);
        # a value that cannot be pickled fails here, visibly, not in the queue's feeder thread.
        results.put((rank, True, pickle.dumps(worker(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 (every failure, an exit included, is the test's to report)
        results.put((rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):  # teardown after a failure: the failure is reported
            destroy_tensor_parallel()
        results.close()
        results.join_thread()
        os._exit(0)  # skip interpreter teardown: a wedged NCCL/IPC destructor must not hang the test


def run_distributed(worker: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout_s: float = 90.0,
                    device_kind: str = "cpu", node_ranks: list[int] | None = None) -> list[Any]:
    """``[worker's return value for rank r]``; raises AssertionError with a failing rank's traceback,
    or TimeoutError naming the ranks that did not finish within ``STARTUP_ALLOWANCE_S + timeout_s``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(worker, r, world_size, port, device_kind, results, args, node_ranks), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        import time

        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + timeout_s
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise TimeoutError(f"ranks {missing} did not finish within {STARTUP_ALLOWANCE_S + timeout_s:.0f}s (hang?)")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            outcome[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    if failures:
        raise AssertionError("\n".join(failures))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


def run_under_triton_interpreter(worker: Callable[..., Any], timeout_s: float = 240.0, world_size: int = 1,
                                 args: tuple = ()) -> Any:
    """``worker(0, 1, *args)`` in one spawned process with ``TRITON_INTERPRET=1`` (the interpreter
    is chosen when triton is first imported, so it cannot be switched on inside pytest's process);
    with ``world_size`` > 1 the list of every rank's return value (`run_distributed`)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        results = run_distributed(worker, world_size=world_size, args=args, timeout_s=timeout_s)
        return results[0] if world_size == 1 else results
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def make_fusion(hidden: int, dtype: torch.dtype = torch.float32, **config: Any) -> Any:
    """Collective: a set-up `fusion.AllReduceFusion` over this rank's TP group for a model of
    ``hidden`` and ``dtype``, from `fusion.FusionConfig` fields (default: fusion off)."""
    from arfusion.fusion import AllReduceFusion, FusionConfig
    from arfusion.layers.parallel_state import get_tp_group

    fusion = AllReduceFusion(get_tp_group(), FusionConfig(**config), hidden, dtype)
    fusion.setup()
    return fusion


class AllReduceCounter:
    """Counts the activation all-reduces over ``group`` from now on: the eager calls of
    ``torch.distributed.all_reduce`` on its device group (the group's own ``all_reduce``, which
    the NCCL path and every layer that reduces use, and the torch strategy's one-call path, which
    calls the device group directly), plus those through the group's capturable stand-in.
    ``total`` so far."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.total = 0
        device_group, original = group.device_group, dist.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group", args[1] if len(args) > 1 else None) is device_group:
                self.total += 1
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        if group.capturable is not None:
            stand_in = group.capturable.all_reduce

            def counted_stand_in(x: torch.Tensor) -> torch.Tensor:
                self.total += 1
                return stand_in(x)

            group.capturable.all_reduce = counted_stand_in


def reductions(counter: AllReduceCounter, fusion: Any) -> int:
    """Every activation reduction since ``counter`` started: the group's all-reduces plus the
    fusion op's reductions by kernels that do not call the group (all but nccl and torch)."""
    return counter.total + sum(n for s, n in fusion.counts.items() if s not in ("nccl", "torch"))
