"""Two SGLang TP ranks over gloo in spawned processes: SGLang's own ``load_plugins()`` loads the
plugin through its entry point, SGLang's own ``init_distributed_environment`` /
``initialize_model_parallel`` make the TP group, and each rank runs a scenario against SGLang's
real functions, returning what the test asserts."""
from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from tests.dist_utils import free_port
from tests.sglang.conftest import FAKE_TORCHVISION


def _entry(scenario: Callable[[int], Any], rank: int, port: int, results: Any) -> None:
    os.environ["ARFUSION_SGLANG"] = "1"
    sys.path.insert(0, FAKE_TORCHVISION)
    torch.set_num_threads(1)
    try:
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.plugins import load_plugins

        load_plugins()
        ps.init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        local_rank=rank, backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        # plain pickle: tensor data copied, not shared through fds that die with this process
        value = pickle.dumps(scenario(rank))
        # rank 0 hosts the store: it stays until every rank has finished with it
        torch.distributed.barrier(group=ps.get_world_group().cpu_group)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def run_two_ranks(scenario: Callable[[int], Any], timeout_s: float = 300.0) -> list[Any]:
    """``scenario(rank)`` on two SGLang TP ranks; its return values in rank order. A rank that
    fails or does not answer within ``timeout_s`` fails the call (both ranks are killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(scenario, r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out: dict[int, Any] = {}
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"SGLang rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        return [out[r] for r in range(2)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
