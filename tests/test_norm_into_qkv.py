"""The input norm left pending for the q/k/v projection (layers/pending_norm.py, ``--norm-into-qkv``)
on the CPU.

On the CPU the launch never takes a batch, so the flag alone changes nothing: the tiny model at
TP1 gives the bits of the flag off. Two test-only ways force the pending path through the
production code: ``deferral_refusal`` patched to accept every batch makes each layer after the
first hand a `PendingNorm` to its q/k/v projection, which on the CPU runs the separate norm
(`PendingNorm.materialize`, the fallback a GPU takes for a weight the launch refuses): the same
bits as the flag off, greedy tokens and logits; under Triton's interpreter, with the launch's
device and dtype test patched away too, the tiny model (fp32) runs the launch itself in every
layer after the first: the same greedy tokens, logits within 1e-4 relative (fp32 sums in
another order).

Units: a pending norm runs once; `PendingNorm.materialize` and a `QKVParallelLinear` given one
match `fusion.reference` bit for bit on the CPU; at TP1 a `fusion.PartialSum` is taken from the
fusion op (counted as the fallback's reduction, the new residual trusted as the op's own
output, a second reduction refused); layer 0, batch-invariant mode and TP2 keep the separate norm;
`LayerCommunicator.prepare_attn` hands the pending norm over at TP1."""
import pytest
import torch

from tests.dist_utils import make_fusion, run_distributed, run_under_triton_interpreter
from tests.fold_checks import count_calls, greedy_run

PROMPTS, PROMPT_LEN, STEPS = 3, 7, 6
HIDDEN, EPS = 64, 1e-6


def _run(rank: int, world: int, norm_into_qkv: bool, force: str) -> dict:
    """``force``: "" (as shipped), "materialize" (every batch deferred; the CPU's fallback runs
    it), "launch" (every batch deferred and the launch taking CPU fp32 tensors: the interpreter)."""
    from arfusion.layers import pending_norm

    calls: dict = {}
    if force:
        pending_norm.deferral_refusal = lambda x, residual, weight: None
        count_calls(pending_norm.PendingNorm, "materialize", calls)
        count_calls(pending_norm.PendingNorm, "linear", calls)
    if force == "launch":  # under the interpreter (triton installed)
        from arfusion.layers.kernels import triton_norm_matmul

        triton_norm_matmul.refusal = triton_norm_matmul._problem  # CPU fp32 tensors accepted
    out = greedy_run("tiny", PROMPTS, PROMPT_LEN, STEPS, norm_into_qkv=norm_into_qkv)
    out["calls"] = calls
    return out


@pytest.fixture(scope="module")
def off():
    return run_distributed(_run, world_size=1, args=(False, ""), timeout_s=300)[0]


def test_on_the_cpu_the_flag_alone_keeps_the_bits(off):
    on = run_distributed(_run, world_size=1, args=(True, ""), timeout_s=300)[0]
    assert on["tokens"] == off["tokens"] and torch.equal(on["logits"], off["logits"])
    assert len({t for step in off["tokens"] for t in step}) > 2, "the tokens vary (not a constant stream)"


def test_the_pending_path_falls_back_to_the_separate_norm_with_the_same_bits(off):
    forced = run_distributed(_run, world_size=1, args=(True, "materialize"), timeout_s=300)[0]
    forwards, later_layers = STEPS + 1, 3  # the tiny model's 4 layers: layer 0 normalises the embeddings
    assert forced["calls"] == {"materialize": forwards * later_layers, "linear": forwards * later_layers}
    assert forced["tokens"] == off["tokens"] and torch.equal(forced["logits"], off["logits"])
    assert forced["reductions"] == off["reductions"], "a taken partial sum counts as the reduction it replaces"


def test_without_the_flag_no_norm_is_left_pending():
    forced = run_distributed(_run, world_size=1, args=(False, "materialize"), timeout_s=300)[0]
    assert forced["calls"] == {"materialize": 0, "linear": 0}


@pytest.mark.timeout(900)
def test_the_launch_inside_the_model_gives_the_same_greedy_tokens(off):
    pytest.importorskip("triton")
    launched = run_under_triton_interpreter(_run, timeout_s=800, args=(True, "launch"))
    forwards, later_layers = STEPS + 1, 3
    assert launched["calls"] == {"materialize": 0, "linear": forwards * later_layers}
    assert launched["tokens"] == off["tokens"]
    rel = (launched["logits"] - off["logits"]).flatten(1).norm(dim=1) / off["logits"].flatten(1).norm(dim=1)
    assert rel.max().item() <= 1e-4


# ---- units (in this process: TP1 needs no process group)

def _norm(weight: torch.Tensor):
    from arfusion.layers.layernorm import RMSNorm

    norm = RMSNorm(HIDDEN, EPS)
    norm.weight.data.copy_(weight)
    return norm


def _tensors(tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return (torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, HIDDEN, generator=g),
            1 + 0.1 * torch.randn(HIDDEN, generator=g))


@pytest.fixture
def every_batch_deferred(monkeypatch):
    from arfusion.layers import pending_norm

    monkeypatch.setattr(pending_norm, "deferral_refusal", lambda x, residual, weight: None)


@pytest.fixture
def tp1():
    from arfusion.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    group = init_tensor_parallel(1, 0, "tcp://127.0.0.1:0", device=torch.device("cpu"))
    yield group
    destroy_tensor_parallel()


def test_a_pending_norm_runs_once_and_matches_the_reference(every_batch_deferred):
    from arfusion.fusion import reference
    from arfusion.layers.pending_norm import PendingNorm, input_norm

    x, residual, weight = _tensors()
    normed_ref, summed_ref = reference.add_rms_norm(x, residual, weight, EPS)
    pending, residual_out = input_norm(_norm(weight), x.clone(), residual.clone(), fold=True)
    assert isinstance(pending, PendingNorm) and residual_out is pending.residual_out
    assert torch.equal(pending.materialize(), normed_ref) and torch.equal(residual_out, summed_ref)
    with pytest.raises(ValueError, match="consumed once"):
        pending.materialize()
    with pytest.raises(ValueError, match="consumed once"):
        pending.linear(torch.ones(8, HIDDEN), None)
    normed, kept = input_norm(_norm(weight), x.clone(), None, fold=True)
    assert torch.equal(kept, x) and torch.equal(normed, reference.rms_norm(x, weight, EPS)), "layer 0: as before"


def test_qkv_projection_runs_a_pending_norm(tp1, every_batch_deferred):
    import torch.nn.functional as F

    from arfusion.fusion import reference
    from arfusion.layers.linear import QKVParallelLinear
    from arfusion.layers.pending_norm import input_norm

    x, residual, weight = _tensors()
    qkv = QKVParallelLinear(HIDDEN, 16, 2, 1, bias=True)
    torch.nn.init.normal_(qkv.weight)
    torch.nn.init.normal_(qkv.bias)
    normed_ref, summed_ref = reference.add_rms_norm(x, residual, weight, EPS)
    pending, residual_out = input_norm(_norm(weight), x, residual, fold=True)
    assert torch.equal(qkv(pending), F.linear(normed_ref, qkv.weight, qkv.bias))
    assert torch.equal(residual_out, summed_ref)


def test_a_partial_sum_is_taken_from_the_fusion_op_at_tp1(tp1, every_batch_deferred):
    from arfusion.fusion import FusionInputError, PartialSum, Strategy, reference
    from arfusion.layers.pending_norm import PendingNorm, input_norm

    fusion = make_fusion(HIDDEN)
    x, residual, weight = _tensors()
    norm = _norm(weight)
    # the op's own reduction first, so that its residual is the trusted one
    first = PartialSum(pending=x.clone(), layer_id=0, op=fusion)
    _, trusted = norm(first, residual.clone())
    partial = PartialSum(pending=x.clone(), layer_id=1, op=fusion)
    pending, residual_out = input_norm(norm, partial, trusted, fold=True)
    assert isinstance(pending, PendingNorm) and partial.pending is None
    assert fusion.counts[Strategy.NCCL] == 2, "counted as the fallback's reduction it replaces"
    assert fusion._inputs.residual is residual_out, "the new residual is trusted as the op's own output"
    with pytest.raises(FusionInputError, match="already reduced"):
        norm(partial, residual_out)
    normed, summed = reference.add_rms_norm(x, trusted, weight, EPS)
    assert torch.equal(pending.materialize(), normed) and torch.equal(residual_out, summed)
    fusion.destroy()


def test_batch_invariant_mode_and_unserved_batches_keep_the_separate_norm(tp1):
    from arfusion.layers import batch_invariant
    from arfusion.layers.kernels.triton_support import triton_available
    from arfusion.layers.pending_norm import PendingNorm, deferral_refusal, input_norm

    x, residual, weight = _tensors()
    assert ("not on a CUDA device" if triton_available() else "triton is not installed") in deferral_refusal(
        x, residual, weight)
    normed, _ = input_norm(_norm(weight), x.clone(), residual.clone(), fold=True)
    assert not isinstance(normed, PendingNorm)
    with batch_invariant.batch_invariant_mode(True):
        assert "batch-invariant" in deferral_refusal(x, residual, weight)


def _communicator(rank: int, world: int) -> dict:
    """A layer's prepare_attn at ``world`` ranks with norm_into_qkv, every batch deferred."""
    from arfusion.fusion import PartialSum
    from arfusion.layers import pending_norm
    from arfusion.layers.communicator import LayerCommunicator

    pending_norm.deferral_refusal = lambda x, residual, weight: None
    fusion = make_fusion(HIDDEN)
    x, residual, weight = _tensors()
    comm = LayerCommunicator(1, 2, _norm(weight), _norm(weight), fusion, norm_into_qkv=True)
    h, summed = comm.prepare_attn(PartialSum(pending=x.clone(), layer_id=0, op=fusion), residual.clone())
    pending = isinstance(h, pending_norm.PendingNorm)
    normed = h.materialize() if pending else h
    fusion.destroy()
    return {"folds": comm.norm_into_qkv, "pending": pending, "normed": normed, "summed": summed}


@pytest.mark.parametrize("world_size", [1, 2])
def test_layer_communicator_hands_the_pending_norm_over_at_tp1_only(world_size):
    from arfusion.fusion import reference

    results = run_distributed(_communicator, world_size=world_size, timeout_s=120)
    x, residual, weight = _tensors()
    normed, summed = reference.add_rms_norm(x * world_size, residual, weight, EPS)
    for r in results:
        assert r["folds"] == r["pending"] == (world_size == 1)
        torch.testing.assert_close(r["normed"], normed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["summed"], summed, rtol=1e-5, atol=1e-5)


def test_the_flag_is_off_by_default_and_reaches_the_runner_and_the_benchmark():
    from arfusion.engine import bench_one_batch
    from arfusion.engine.launch_config import runner_settings
    from arfusion.server_args import ServerArgs

    assert not ServerArgs().norm_into_qkv and not runner_settings(ServerArgs()).norm_into_qkv
    assert runner_settings(ServerArgs.from_cli(["--norm-into-qkv"])).norm_into_qkv
    server, _ = bench_one_batch.parse_args(["--norm-into-qkv"])
    assert server.norm_into_qkv and "--norm-into-qkv" in bench_one_batch.build_parser().format_help()
