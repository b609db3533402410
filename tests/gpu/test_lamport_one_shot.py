"""The one-shot Lamport backend (fusion/backends/lamport_one_shot.py) on 2 TP ranks (one GPU
each, or both on one GPU): against the reference math, the same bits on both ranks, many calls
of changing sizes (the triple buffer wraps), CUDA-graph replays, and a stalled peer.

Reference (fusion/reference.py): ``sum = round(x_0 + x_1)`` in fp32 rounded once (what NCCL's
TP2 all-reduce returns), ``residual_out = round(sum + residual)`` and ``normed`` its fp32
RMSNorm. The kernel does those roundings exactly, so ``residual_out`` must match bit for bit
and ``normed`` within the per-dtype tolerance (its sum of squares runs in another order). Rank
0's x holds a -0.0 (the sentinel's value) in every case: it must arrive, not stall the peer.
"""
import hashlib
import time

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.tp_ranks(2), pytest.mark.timeout(600)]

WORLD, EPS = 2, 1e-6
HIDDENS = (896, 1024, 2048, 4096, 5120, 8192)
TOKENS = (1, 2, 3, 7, 32, 128, 255, 512)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASE_TIMEOUT_NS = 10_000_000_000  # correctness cases: far above any skew of two ranks on one GPU
SEQUENCE = (5, 128, 1, 64, 3, 128, 2, 7, 512, 1, 33)  # changing sizes: a buffer's next call has more rows
GRAPH_TOKENS, GRAPH_REPLAYS = 32, 5
STALL_BOUND_NS, STALL_SLEEP_S = 200_000_000, 3.0


def _inputs(rank, tokens, hidden, dtype, seed, dev):
    """This rank's x, and the residual and weight every rank shares; random, never zero."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    shared = torch.Generator().manual_seed(seed * 100 + 99)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    if rank == 0:
        x[0, 0] = -0.0
    residual = torch.randn(tokens, hidden, generator=shared).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=shared)).to(dtype)
    return x.to(dev), residual.to(dev), weight.to(dev)


def _expected(tokens, hidden, dtype, seed, with_residual, dev):
    """(normed, residual_out) of the reference for every rank's inputs of ``seed``."""
    from arfusion.fusion import reference

    ranks = [_inputs(r, tokens, hidden, dtype, seed, dev) for r in range(WORLD)]
    s = ranks[0][0].float()
    for x, _, _ in ranks[1:]:
        s = s + x.float()
    _, residual, weight = ranks[0]
    return reference.add_rms_norm(s.to(dtype), residual if with_residual else None, weight, EPS)


def _digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check(backend, rank, tokens, hidden, dtype, seed, with_residual, dev):
    """One call against the reference: (residual_out bit-exact, normed error or None, digest)."""
    from tests.tolerances import assert_close

    x, residual, weight = _inputs(rank, tokens, hidden, dtype, seed, dev)
    normed, residual_out, _ = backend.run(x.clone(), residual.clone() if with_residual else None, weight, EPS)
    exp_normed, exp_residual = _expected(tokens, hidden, dtype, seed, with_residual, dev)
    try:
        assert_close(normed, exp_normed)
        normed_error = None
    except AssertionError as exc:
        normed_error = str(exc)[:300]
    return torch.equal(residual_out, exp_residual), normed_error, _digest(normed, residual_out)


def _guarded(fn):
    try:
        return fn()
    except Exception as exc:  # reported per case, so one failure does not hide the others
        return f"{type(exc).__name__}: {exc}"[:400]


def _cases(backend, rank, dev):
    out = {}
    for name, dtype in DTYPES.items():
        for hidden in HIDDENS:
            ready = backend.ensure(max(TOKENS), hidden, dtype)
            for tokens in TOKENS:
                for with_residual in (True, False):
                    key = f"{name}/{hidden}/{tokens}/{'res' if with_residual else 'nores'}"
                    out[key] = _guarded(lambda: _check(backend, rank, tokens, hidden, dtype, 1, with_residual, dev)
                                        if ready else f"not ready: {backend.failure}")
    return out


def _sequence(backend, rank, dev):
    """Consecutive eager calls of changing sizes and inputs, then the control area's state."""
    backend.timeout_ns = 1_000_000_000  # the default bound
    assert backend.ensure(512, 2048, torch.float16), backend.failure
    results = [_check(backend, rank, t, 2048, torch.float16, 10 + i, i % 3 != 1, dev) for i, t in enumerate(SEQUENCE)]
    torch.cuda.synchronize()
    backend.raise_if_failed()
    control = backend._control.cpu().tolist()
    return {"calls": results, "index": control[0], "arrivals": control[1], "error": control[2], "rows": control[3:6]}


def _graph(backend, rank, dev):
    """One capture of a call on static tensors, replayed with new inputs copied in."""
    from arfusion.fusion import reference

    hidden, dtype = 4096, torch.bfloat16
    assert backend.ensure(512, hidden, dtype), backend.failure
    x, residual, weight = _inputs(rank, GRAPH_TOKENS, hidden, dtype, 20, dev)
    static_x, static_res = x.clone(), residual.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # eager warm-up on the capture's stream
        backend.run(x.clone(), residual.clone(), weight, EPS)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, residual_out, _ = backend.run(static_x, static_res, weight, EPS)
    replays = []
    for i in range(GRAPH_REPLAYS):
        nx, nres, _ = _inputs(rank, GRAPH_TOKENS, hidden, dtype, 21 + i, dev)
        static_x.copy_(nx)
        static_res.copy_(nres)
        graph.replay()
        torch.cuda.synchronize()
        _, exp_residual = _expected(GRAPH_TOKENS, hidden, dtype, 21 + i, True, dev)
        exp_normed = reference.rms_norm(exp_residual, weight, EPS)  # the captured weight (seed 20)
        err = ((normed.float() - exp_normed.float()).norm() / exp_normed.float().norm()).item()
        replays.append((torch.equal(residual_out, exp_residual), err))
    backend.raise_if_failed()
    return replays


def _stall(backend, rank, group, dev):
    """Rank 1 stays away while rank 0 calls with a short bound; rank 0 must report, not hang."""
    from arfusion.fusion.errors import FusionInputError, FusionTimeoutError

    hidden, dtype = 4096, torch.bfloat16
    assert backend.ensure(512, hidden, dtype), backend.failure
    x, residual, weight = _inputs(rank, 4, hidden, dtype, 30, dev)
    backend.run(x.clone(), residual.clone(), weight, EPS)  # both ranks: in step
    torch.cuda.synchronize()
    group.all_agree(True)
    out = {}
    if rank == 1:
        time.sleep(STALL_SLEEP_S)
        out["fits"] = backend.fits(4)
    else:
        backend.timeout_ns = STALL_BOUND_NS
        start = time.monotonic()
        backend.run(x.clone(), residual.clone(), weight, EPS)
        torch.cuda.synchronize()  # the engine reads the flag once a step's results reached the host
        try:
            backend.raise_if_failed()
            out["raised"] = None
        except FusionTimeoutError as exc:
            out["raised"] = str(exc)
        out["elapsed_s"] = time.monotonic() - start
        out["fits"] = backend.fits(4)
        try:
            backend.run(x.clone(), residual.clone(), weight, EPS)
            out["refused"] = None
        except FusionInputError as exc:
            out["refused"] = str(exc)
    group.all_agree(True)
    return out


def _run(rank, world_size):
    from arfusion.fusion.backends.lamport_one_shot import LamportOneShotBackend
    from arfusion.layers.parallel_state import get_tp_group

    group = get_tp_group()
    dev = group.device
    backend = LamportOneShotBackend(group, timeout_ns=CASE_TIMEOUT_NS)
    out = {"cases": _cases(backend, rank, dev), "shared_gpu": group.shares_gpu}
    out["sequence"] = _guarded(lambda: _sequence(backend, rank, dev))
    out["graph"] = _guarded(lambda: _graph(backend, rank, dev))
    backend.timeout_ns = CASE_TIMEOUT_NS
    out["stall"] = _guarded(lambda: _stall(backend, rank, group, dev))
    backend.destroy()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, world_size=WORLD, device_kind="cuda", timeout_s=300)


CASE_KEYS = [f"{n}/{h}/{t}/{r}" for n in DTYPES for h in HIDDENS for t in TOKENS for r in ("res", "nores")]


@pytest.mark.parametrize("key", CASE_KEYS)
def test_matches_the_reference_and_every_rank_gets_the_same_bits(results, key):
    per_rank = [r["cases"][key] for r in results]
    for value in per_rank:
        assert not isinstance(value, str), value
        residual_exact, normed_error, _ = value
        assert residual_exact, "residual_out differs from round(round(x0 + x1) + residual)"
        assert normed_error is None, normed_error
    assert per_rank[0][2] == per_rank[1][2], "the ranks' outputs differ"


@pytest.mark.parametrize("key", [k for k in CASE_KEYS if k.endswith("/nores")])
def test_the_tp2_sum_is_nccls_sum_of_two_values_rounded_once(results, key):
    value = results[0]["cases"][key]  # without a residual, residual_out is the all-reduced sum
    assert not isinstance(value, str), value
    assert value[0], "sum differs from (x0.float() + x1.float()).to(dtype)"


def test_consecutive_calls_of_changing_sizes_wrap_the_triple_buffer(results):
    for r in results:
        seq = r["sequence"]
        assert not isinstance(seq, str), seq
        for i, (residual_exact, normed_error, _) in enumerate(seq["calls"]):
            assert residual_exact and normed_error is None, (i, SEQUENCE[i], normed_error)
        n = len(SEQUENCE)
        assert seq["index"] == n % 3 and seq["arrivals"] == 0 and seq["error"] == 0, seq
        assert seq["rows"][(n - 1) % 3] == SEQUENCE[-1], seq
    assert [c[2] for c in results[0]["sequence"]["calls"]] == [c[2] for c in results[1]["sequence"]["calls"]]


def test_graph_replays_with_new_inputs_rotate_buffers_on_the_device(results):
    for r in results:
        assert not isinstance(r["graph"], str), r["graph"]
        assert len(r["graph"]) == GRAPH_REPLAYS
        for residual_exact, err in r["graph"]:
            assert residual_exact and err < 1e-2, r["graph"]


def test_a_stalled_peer_makes_the_waiting_rank_raise_within_the_bound(results):
    waiting, away = results[0]["stall"], results[1]["stall"]
    assert not isinstance(waiting, str) and not isinstance(away, str), (waiting, away)
    assert waiting["raised"] is not None, "no FusionTimeoutError"
    assert "rank 0" in waiting["raised"] and "rank 1's rows" in waiting["raised"] and "200 ms" in waiting["raised"]
    assert STALL_BOUND_NS / 1e9 <= waiting["elapsed_s"] < STALL_BOUND_NS / 1e9 + 1.0, waiting["elapsed_s"]
    assert not waiting["fits"] and "off after a timeout" in waiting["refused"]
    assert away["fits"], "the rank that never waited is not failed"
