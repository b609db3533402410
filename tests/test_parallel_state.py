"""`init_tensor_parallel`'s two bounds (TP2 over gloo): a rank that joins later than ``timeout_s``
(a slow start-up) still joins, since the rendezvous waits `RENDEZVOUS_TIMEOUT_S`; once joined, a
collective that a peer never enters fails after ``timeout_s``, not after the rendezvous' wait."""
import multiprocessing as mp
import time

import pytest

from tests.dist_utils import free_port

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 2.0
LATE_S = 3 * TIMEOUT_S  # how much later than rank 0 rank 1 joins


def _rank(rank: int, port: int, results) -> None:
    import torch

    from arfusion.layers.parallel_state import init_tensor_parallel

    if rank == 1:
        time.sleep(LATE_S)
    try:
        group = init_tensor_parallel(2, rank, f"tcp://127.0.0.1:{port}", device=torch.device("cpu"), timeout_s=TIMEOUT_S)
    except Exception as exc:
        results.put((rank, "join failed", repr(exc), 0.0))
        return
    if rank == 1:
        results.put((rank, "joined", "", 0.0))
        time.sleep(600)  # never enters rank 0's collective; the test kills it
    start = time.monotonic()
    try:
        group.all_gather_object(rank)
        results.put((rank, "collective completed", "", time.monotonic() - start))
    except Exception as exc:
        results.put((rank, "collective failed", repr(exc), time.monotonic() - start))


def test_a_late_rank_joins_and_a_collective_without_it_fails_after_timeout_s():
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        outcomes = {}
        while len(outcomes) < 2:
            rank, what, error, seconds = results.get(timeout=240)
            outcomes[rank] = (what, error, seconds)
        assert procs[1].is_alive(), "rank 1 must still be away when rank 0's collective gives up"
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
    assert outcomes[1][0] == "joined", outcomes
    what, error, seconds = outcomes[0]
    assert what == "collective failed" and seconds >= TIMEOUT_S, outcomes
