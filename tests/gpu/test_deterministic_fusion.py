"""Deterministic mode of the fused op on the GPU: a row's bits never depend on the other rows
of the call, across every strategy the mode allows and every cut-off of the dispatch, eager and
in a CUDA graph.

Collective part (``tp_ranks``: 2 ranks, on two GPUs or sharing one): hidden 896 and 4096, bf16,
fusion max tokens 1024 (the fused two-shot's buffer rows: beyond it, it runs in chunks; the
symmetric-memory two-shot's limit), the Lamport one-shot's 512 rows; T = 1 ... 4096 with the
counts just below and above each cut-off. Fixed random probe rows sit at a position that moves
with T among T - 1 other random rows. For every T, every allowed strategy that fits T
(``AllReduceFusion.run``), the dispatch's own choice, and, for a few T, each strategy captured
in a CUDA graph and replayed: at each T every path's whole output must be bit-identical, and the
probes' normed output and new residual bit-identical to every other T's, on both ranks; and within bf16 rounding of an fp32 reference
(a wrong row is off by O(1)). Ranks sharing a GPU get the symmetric-memory stand-in for their
gloo collectives (`fusion.enable_capturable_collectives`), so the nccl path is captured too.

Norm part (``gpus(1)``): the unfused tail's Triton kernel (`fusion.backends.deterministic.add_rms_norm`)
row-invariant for T = 1 ... 4096, and its rank-order sum of P partial rows equal, bit for bit,
to torch's fp32 rank-order sum followed by the P = 1 kernel.
"""
import pytest
import torch

from arfusion.fusion import PartialSum, Strategy
from tests.dist_utils import run_distributed

EPS = 1e-6
HIDDENS = (896, 4096)
MAX_TOKENS = 1024  # fusion max tokens = the fused two-shot's buffer rows = the two-shot's limit
LAMPORT_ROWS = 512
TOKEN_COUNTS = (1, 2, 3, 7, 64, 65, 127, 128, 129, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4096)
GRAPH_TOKENS = (1, 512, 513, 1024, 1025)
PROBES = 2
MAX_REL_ERR = 1e-2  # bf16 rounding of a normed row against fp32


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _inputs(rank: int, tokens: int, hidden: int, dev: torch.device):
    """This rank's partial sums with the probe rows at a moving position; residual, weight, probe row."""
    g = torch.Generator().manual_seed(10_000 * tokens + rank)
    x = 2 * torch.randn(tokens, hidden, generator=g)
    residual = 2 * torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(10_000 * tokens + 999))
    n = min(PROBES, tokens)
    at = (7 * tokens) % (tokens - n + 1)
    x[at:at + n] = 2 * torch.randn(PROBES, hidden, generator=torch.Generator().manual_seed(rank))[:n]
    residual[at:at + n] = 2 * torch.randn(PROBES, hidden, generator=torch.Generator().manual_seed(999))[:n]
    weight = torch.rand(hidden, generator=torch.Generator().manual_seed(5)) + 0.5
    to = dict(device=dev, dtype=torch.bfloat16)
    return x.to(**to), residual.to(**to), weight.to(**to), at


def _probe_expected(world, tokens, hidden, dev):
    """The probes' normed rows in fp32 math from every rank's inputs."""
    ins = [_inputs(r, tokens, hidden, dev) for r in range(world)]
    at, n = ins[0][3], min(PROBES, tokens)
    s = sum(i[0][at:at + n].float() for i in ins) + ins[0][1][at:at + n].float()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * ins[0][2].float()


def _graphed(fusion, strategy, x, residual, weight):
    """``fusion.run(strategy)`` captured in a CUDA graph (after one warm-up on a side stream),
    replayed on ``x`` and ``residual`` copied into its static inputs."""
    static_x, static_res = x.clone(), residual.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fusion.run(strategy, x.clone(), residual.clone(), weight, EPS)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fusion.run(strategy, static_x, static_res, weight, EPS)
    static_x.copy_(x)
    static_res.copy_(residual)
    graph.replay()
    torch.cuda.synchronize()
    return out.normed, out.residual


def _sweep(rank, world, hidden):
    from arfusion.fusion import enable_capturable_collectives
    from arfusion.layers.parallel_state import get_tp_group
    from tests.dist_utils import make_fusion

    group = get_tp_group()
    capturable = enable_capturable_collectives(group, max(TOKEN_COUNTS) * hidden * 2) if group.shares_gpu else None
    fusion = make_fusion(hidden, torch.bfloat16, enabled=True, deterministic=True, max_tokens=MAX_TOKENS,
                         table_path="none", tune_at_startup=False)
    fusion.ensure_all(MAX_TOKENS)  # the Lamport one-shot (512 rows) and the two-shot too
    status = fusion.status()
    allowed = [Strategy(s) for s in status["deterministic_strategies"]]
    probes, errors, picked, failures, differs = {}, {}, {}, {}, {}
    first = {}  # per T: the first path's whole output, which every other path must equal bit for bit

    def keep(key, normed, residual_out, tokens, at):
        whole = (_bits(normed).clone(), _bits(residual_out).clone())
        if tokens not in first:
            first[tokens] = whole
        else:
            n_diff = sum(int((a != b).sum()) for a, b in zip(whole, first[tokens]))
            if n_diff:
                differs[key] = n_diff
        n = min(PROBES, tokens)
        probes[key] = (_bits(normed[at:at + n]).cpu(), _bits(residual_out[at:at + n]).cpu())
        errors[key] = ((normed[at:at + n].float() - expected).norm() / expected.norm()).item()

    for tokens in TOKEN_COUNTS:
        x, residual, weight, at = _inputs(rank, tokens, hidden, group.device)
        expected = _probe_expected(world, tokens, hidden, group.device)
        picked[tokens] = fusion.strategy(0, tokens).value
        partial = PartialSum(pending=x.clone(), layer_id=0, op=fusion)
        keep(("dispatch", tokens), *fusion.reduce_add_rms_norm(partial, residual.clone(), weight, EPS), tokens, at)
        for strategy in allowed:
            if not fusion.backends[strategy].fits(tokens):
                continue
            try:
                keep((strategy.value, tokens), *fusion.run(strategy, x.clone(), residual.clone(), weight, EPS)[:2],
                     tokens, at)
                if tokens in GRAPH_TOKENS and (strategy is not Strategy.NCCL or not group.shares_gpu
                                               or capturable is None):
                    keep((f"{strategy.value}/graph", tokens), *_graphed(fusion, strategy, x, residual, weight),
                         tokens, at)
            except Exception as exc:
                failures[(strategy.value, tokens)] = f"{type(exc).__name__}: {exc}"[:300]
    fits = {s.value: [t for t in TOKEN_COUNTS if fusion.backends[s].fits(t)] for s in allowed}
    fusion.destroy()
    return {"status": status, "probes": probes, "errors": errors, "picked": picked, "failures": failures,
            "differs": differs,
            "fits": fits, "capturable": capturable, "shares_gpu": group.shares_gpu}


@pytest.fixture(scope="module", params=HIDDENS, ids=[f"hidden{h}" for h in HIDDENS])
def swept(request):
    return run_distributed(_sweep, world_size=2, args=(request.param,), device_kind="cuda", timeout_s=540)


@pytest.mark.tp_ranks(2)
@pytest.mark.timeout(900)
def test_every_allowed_strategy_is_set_up_and_flashinfer_is_left_out(swept):
    result = swept[0]
    status = result["status"]
    assert status["deterministic"] and status["active"], status
    assert set(status["deterministic_strategies"]) == {"nccl", "symm_mem_two_shot", "symm_mem_fused",
                                                       "lamport_one_shot"}, status
    assert {"flashinfer_one_shot", "flashinfer_two_shot"} <= set(status["deterministic_excluded"])
    assert result["capturable"] is None, result["capturable"]
    assert not result["failures"], result["failures"]
    fits = result["fits"]
    assert 512 in fits["lamport_one_shot"] and 513 not in fits["lamport_one_shot"], fits
    assert 1024 in fits["symm_mem_two_shot"] and 1025 not in fits["symm_mem_two_shot"], fits
    assert fits["symm_mem_fused"] == list(TOKEN_COUNTS), fits  # beyond its buffer: in chunks


@pytest.mark.tp_ranks(2)
@pytest.mark.timeout(900)
def test_rows_are_bit_identical_across_batches_strategies_graphs_and_ranks(swept):
    reference = swept[0]["probes"][("nccl", max(TOKEN_COUNTS))]
    compared = 0
    for result in swept:  # at each T every path's whole output equals the first path's
        assert not result["differs"], f"elements differing from another strategy at the same T: {result['differs']}"
        for (name, tokens), (normed, residual_out) in result["probes"].items():
            n = normed.shape[0]
            assert torch.equal(residual_out, reference[1][:n]), f"{name} at T={tokens}: residual bits differ"
            assert torch.equal(normed, reference[0][:n]), f"{name} at T={tokens}: normed bits differ"
            compared += 1
    names = {name for name, _ in swept[0]["probes"]}
    assert {"symm_mem_fused/graph", "lamport_one_shot/graph", "nccl", "dispatch"} <= names, names
    assert compared >= 2 * 4 * len(TOKEN_COUNTS)


@pytest.mark.tp_ranks(2)
@pytest.mark.timeout(900)
def test_rows_are_right(swept):
    worst = max(swept[0]["errors"].values())
    assert worst < MAX_REL_ERR, sorted(swept[0]["errors"].items(), key=lambda kv: -kv[1])[:5]


def _norm_kernel(rank, world):
    from arfusion.fusion import reference
    from arfusion.fusion.backends import deterministic

    dev = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for hidden in HIDDENS:
        probe = {}
        for tokens in TOKEN_COUNTS:
            s, residual, weight, at = _inputs(0, tokens, hidden, dev)
            normed, residual_out = deterministic.add_rms_norm(s.clone(), residual.clone(), weight, EPS)
            n = min(PROBES, tokens)
            probe[tokens] = (_bits(normed[at:at + n]).cpu(), _bits(residual_out[at:at + n]).cpu())
        ref = probe[max(TOKEN_COUNTS)]
        out[f"row_invariant/{hidden}"] = all(torch.equal(nb, ref[0][:nb.shape[0]]) and torch.equal(rb, ref[1][:rb.shape[0]])
                                             for nb, rb in probe.values())
        parts = torch.stack([_inputs(r, 33, hidden, dev)[0] for r in range(3)])
        _, residual, weight, _ = _inputs(0, 33, hidden, dev)
        from arfusion.fusion.backends.kernels.reduce_add_rms_norm import reduce_add_rms_norm

        fused_out, fused_res = torch.empty_like(residual), torch.empty_like(residual)
        reduce_add_rms_norm(parts, residual, fused_out, fused_res, weight, EPS)
        summed = reference.rank_order_sum(list(parts))
        two_step = deterministic.add_rms_norm(summed.clone(), residual.clone(), weight, EPS)  # in place on a GPU
        out[f"parts/{hidden}"] = torch.equal(_bits(fused_out), _bits(two_step[0])) and torch.equal(
            _bits(fused_res), _bits(two_step[1]))
        canonical = reference.canonical_add_rms_norm(summed, residual, weight, EPS)
        out[f"err/{hidden}"] = ((fused_out.float() - canonical[0].float()).norm() / canonical[0].float().norm()).item()
    return out


@pytest.mark.gpus(1)
@pytest.mark.timeout(300)
def test_unfused_tail_kernel_is_row_invariant_and_sums_in_rank_order():
    result = run_distributed(_norm_kernel, world_size=1, device_kind="cuda", timeout_s=240)[0]
    for hidden in HIDDENS:
        assert result[f"row_invariant/{hidden}"], result
        assert result[f"parts/{hidden}"], result
        assert result[f"err/{hidden}"] < MAX_REL_ERR, result
