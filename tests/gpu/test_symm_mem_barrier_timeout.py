"""A peer that never reaches the symmetric-memory barrier makes the waiting rank fail loudly
within the barrier's timeout instead of spinning forever (`fusion.backends.symmetric_buffer`).

Two ranks allocate a symmetric buffer and pass one barrier together; then rank 1 takes another
path and stays alive (its memory stays mapped) while rank 0 enters a second barrier with the
timeout lowered to 2 s. The barrier kernel traps on the device, which is not an exception
Python can catch: the CUDA context is lost and the process terminates. Measured on 2 x H200:
rank 0 must exit with an error, with torch's "[FATAL] CUDASymmetricMemory::barrier" line in
its output, while rank 1 is still alive (so the timeout, not a vanished peer, ended it).
"""
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.dist_utils import free_port

TIMEOUT_MS = 2000
PEER_AWAY_S = 45.0  # rank 1 stays alive (its buffer mapped) well past rank 0's timeout
EXIT_WITHOUT_ERROR = 3  # rank 0's exit code if the barrier returned without its peer


def _rank(rank: int, port: int) -> None:
    import arfusion.fusion.backends.symmetric_buffer as symmetric_buffer
    from arfusion.layers.parallel_state import get_tp_group, init_tensor_parallel

    init_tensor_parallel(2, rank, f"tcp://127.0.0.1:{port}", device=torch.device("cuda", rank), timeout_s=60)
    buffer = symmetric_buffer.SymmetricBuffer(get_tp_group(), "barrier-timeout test")
    if not buffer.ensure(4096, torch.bfloat16):
        os._exit(4)
    buffer.barrier()  # both ranks: passes
    torch.cuda.synchronize()
    symmetric_buffer.BARRIER_TIMEOUT_MS = TIMEOUT_MS
    if rank == 1:
        time.sleep(PEER_AWAY_S)
        os._exit(0)
    buffer.barrier()  # rank 0 alone
    torch.cuda.synchronize()
    os._exit(EXIT_WITHOUT_ERROR)


@pytest.mark.gpus(2, reason="a rank whose barrier kernel traps must leave its peer alive; ranks sharing one GPU share its fault")
@pytest.mark.timeout(120)
def test_a_barrier_without_its_peer_fails_instead_of_hanging(capfd):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=PEER_AWAY_S - 5)
        peer_alive = procs[1].is_alive()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    captured = capfd.readouterr()
    output = captured.out + captured.err  # the device's printf goes to stdout
    print(f"\nrank 0 exit code {procs[0].exitcode}, peer alive when it ended: {peer_alive}")
    assert procs[0].exitcode is not None and procs[0].exitcode not in (0, EXIT_WITHOUT_ERROR, 4), procs[0].exitcode
    assert peer_alive, "rank 0 ended only after its peer had gone"
    assert "[FATAL] CUDASymmetricMemory::barrier" in output, output[-2000:]
