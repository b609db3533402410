"""The post-attention norm left pending for a MoE block's routing launch (layers/pending_norm.py
``post_attention_norm``, ``--norm-into-route``) on the CPU, in the tiny Qwen3-MoE (``tiny-moe``:
4 layers, hidden 256, 8 experts, top-2) at TP1.

On the CPU the launch never takes a batch, so the flag alone changes nothing: the bits of the
flag off. Two test-only ways force the pending path through the production code:
`TopKRouter.norm_deferral_refusal` patched to accept every batch makes every layer hand its MoE
block a `PendingNorm`, which on the CPU the router materializes (`TopKRouter.route_normed`: the
launch refuses a CPU batch, the fallback a GPU takes for a batch the launch refuses): the same
bits as the flag off, greedy tokens and logits, alone and with ``--norm-into-qkv`` forced the
same way;
under Triton's interpreter, with the launch's device and dtype test patched away too and its
one-launch path taken at every batch (prefill included), the model
(fp32) runs the routing launch with the norm inside in every layer: the same greedy tokens,
logits within 1e-4 relative (an element of the normed h may differ by an fp32 ulp: the launch's
``1 / sqrt`` and sum of squares round in another order than torch's).

Units: `SparseMoeBlock` and gpt-oss's `GptOssMoeBlock` given a pending norm give the bits of
the normed input, the new residual the reference's sum; a pending norm runs once; a dense layer,
TP2, batch-invariant mode and the CPU keep the separate norm; `LayerCommunicator.prepare_mlp`
given the router hands the pending norm over at TP1; the flag reaches the config."""
import pytest
import torch

from tests.dist_utils import make_fusion, run_distributed, run_under_triton_interpreter
from tests.fold_checks import count_calls, greedy_run

PROMPTS, PROMPT_LEN, STEPS = 3, 7, 6
LAYERS = 4  # tiny-moe's; every layer's post-attention norm has a residual
HIDDEN, EPS = 64, 1e-6


def _run(rank: int, world: int, norm_into_route: bool, norm_into_qkv: bool, force: str) -> dict:
    """``force``: "" (as shipped), "materialize" (every batch deferred, for q/k/v too; the CPU's
    fallback runs it), "launch" (every batch deferred and the routing launch taking CPU fp32
    tensors: the interpreter)."""
    from arfusion.layers import pending_norm
    from arfusion.layers.moe.router import TopKRouter

    calls: dict = {}
    if force:
        TopKRouter.norm_deferral_refusal = lambda self, x, residual, weight: None
        pending_norm.deferral_refusal = lambda x, residual, weight: None
        for name in ("materialize", "run_in", "linear"):
            count_calls(pending_norm.PendingNorm, name, calls)
    if force == "launch":  # under the interpreter (triton installed); CPU fp32 tensors accepted
        from arfusion.layers.moe.kernels import triton_route_norm, triton_router

        triton_router.norm_refusal = lambda x, residual, weight, top_k: triton_route_norm.batch_problem(
            x, residual, weight)
        triton_router.takes_one_launch = lambda tokens, top_k, grouped=True: tokens * top_k <= triton_router.FUSED_MAX_SLOTS
    out = greedy_run("tiny-moe", PROMPTS, PROMPT_LEN, STEPS, norm_into_qkv=norm_into_qkv,
                     norm_into_route=norm_into_route)
    out["calls"] = calls
    return out


@pytest.fixture(scope="module")
def off():
    return run_distributed(_run, world_size=1, args=(False, False, ""), timeout_s=300)[0]


def test_on_the_cpu_the_flag_alone_keeps_the_bits(off):
    on = run_distributed(_run, world_size=1, args=(True, False, ""), timeout_s=300)[0]
    flags = [(r["config"].norm_into_qkv, r["config"].norm_into_route) for r in (off, on)]
    assert flags == [(False, False), (False, True)], "the flag reaches the model's config"
    assert on["tokens"] == off["tokens"] and torch.equal(on["logits"], off["logits"])
    assert len({t for step in off["tokens"] for t in step}) > 2, "the tokens vary (not a constant stream)"


@pytest.mark.parametrize("norm_into_qkv", [False, True], ids=["route", "route+qkv"])
def test_the_pending_path_falls_back_to_the_separate_norm_with_the_same_bits(off, norm_into_qkv):
    forced = run_distributed(_run, world_size=1, args=(True, norm_into_qkv, "materialize"), timeout_s=300)[0]
    forwards = STEPS + 1
    qkv = forwards * (LAYERS - 1) if norm_into_qkv else 0  # layer 0 normalises the embeddings alone
    assert forced["calls"] == {"run_in": forwards * LAYERS, "materialize": forwards * LAYERS + qkv, "linear": qkv}
    assert forced["tokens"] == off["tokens"] and torch.equal(forced["logits"], off["logits"])
    assert forced["reductions"] == off["reductions"], "a taken partial sum counts as the reduction it replaces"


def test_without_the_flag_no_norm_is_left_pending():
    forced = run_distributed(_run, world_size=1, args=(False, False, "materialize"), timeout_s=300)[0]
    assert forced["calls"] == {"materialize": 0, "run_in": 0, "linear": 0}


@pytest.mark.timeout(900)
def test_the_launch_inside_the_model_gives_the_same_greedy_tokens(off):
    pytest.importorskip("triton")
    launched = run_under_triton_interpreter(_run, timeout_s=800, args=(True, False, "launch"))
    assert launched["calls"] == {"run_in": (STEPS + 1) * LAYERS, "materialize": 0, "linear": 0}
    assert launched["tokens"] == off["tokens"]
    rel = (launched["logits"] - off["logits"]).flatten(1).norm(dim=1) / off["logits"].flatten(1).norm(dim=1)
    assert rel.max().item() <= 1e-4


# ---- units

def _folds(rank: int, world: int) -> dict:
    """Whether each layer folds its post-attention norm, in tiny-moe and tiny (dense) with
    norm_into_route, at ``world`` ranks."""
    import dataclasses

    from arfusion.engine.models.builtin import builtin_config
    from arfusion.engine.models.registry import build_model

    out = {}
    for name in ("tiny-moe", "tiny"):
        config = dataclasses.replace(builtin_config(name), norm_into_route=True)
        fusion = make_fusion(config.hidden_size)
        out[name] = [layer.route_refusal is not None for layer in build_model(config, fusion).model.layers]
        fusion.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_only_moe_layers_at_tp1_fold_the_post_attention_norm(world_size):
    for result in run_distributed(_folds, world_size=world_size, timeout_s=120):
        assert result["tiny"] == [False] * LAYERS, "a dense MLP keeps the separate norm"
        assert result["tiny-moe"] == [world_size == 1] * LAYERS


@pytest.fixture
def tp1():
    from arfusion.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    group = init_tensor_parallel(1, 0, "tcp://127.0.0.1:0", device=torch.device("cpu"))
    yield group
    destroy_tensor_parallel()


def _every_batch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    return None


def _inputs(tokens: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return (torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, HIDDEN, generator=g),
            1 + 0.1 * torch.randn(HIDDEN, generator=g))


def _norm(weight: torch.Tensor):
    from arfusion.layers.layernorm import RMSNorm

    norm = RMSNorm(HIDDEN, EPS)
    norm.weight.data.copy_(weight)
    return norm


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(1)
    for param in module.parameters():
        param.data.copy_(0.2 * torch.randn(param.shape, generator=g))
    return module


def _moe_blocks() -> dict:
    from arfusion.layers.moe import SparseMoeBlock
    from arfusion.layers.moe.gpt_oss_moe import GptOssMoeBlock

    return {"qwen3-moe": _randomized(SparseMoeBlock(HIDDEN, 8, 2, 32, renormalize=True)),
            "gpt-oss": _randomized(GptOssMoeBlock(HIDDEN, 8, 2, 32, 1.702, 7.0, mxfp4=False, dtype=None,
                                                  device=None))}


@pytest.mark.parametrize("block", ["qwen3-moe", "gpt-oss"])
def test_moe_blocks_run_a_pending_norm_with_the_bits_of_the_normed_input(tp1, block):
    from arfusion.fusion import reference
    from arfusion.layers.pending_norm import PendingNorm, post_attention_norm

    moe = _moe_blocks()[block]
    x, residual, weight = _inputs()
    normed_ref, summed_ref = reference.add_rms_norm(x, residual, weight, EPS)
    pending, residual_out = post_attention_norm(_norm(weight), x.clone(), residual.clone(), _every_batch)
    assert isinstance(pending, PendingNorm) and residual_out is pending.residual_out
    assert torch.equal(moe(pending), moe(normed_ref)) and torch.equal(residual_out, summed_ref)
    with pytest.raises(ValueError, match="consumed once"):
        moe(pending)
    normed, summed = post_attention_norm(_norm(weight), x.clone(), residual.clone(), None)
    assert torch.equal(normed, normed_ref) and torch.equal(summed, summed_ref), "not folded: today's norm"


def test_batch_invariant_mode_and_the_cpu_keep_the_separate_norm(tp1):
    from arfusion.layers import batch_invariant
    from arfusion.layers.pending_norm import PendingNorm, post_attention_norm

    from arfusion.layers.kernels.triton_support import triton_available

    refusal = _moe_blocks()["qwen3-moe"].gate.norm_deferral_refusal
    x, residual, weight = _inputs(tokens=1)  # a batch the launch takes by its size
    assert ("not on a CUDA device" if triton_available() else "triton is not installed") in refusal(x, residual, weight)
    normed, _ = post_attention_norm(_norm(weight), x.clone(), residual.clone(), refusal)
    assert not isinstance(normed, PendingNorm)
    with batch_invariant.batch_invariant_mode(True):
        assert "batch-invariant" in refusal(x, residual, weight)


def _communicator(rank: int, world: int) -> dict:
    """A MoE layer's prepare_mlp at ``world`` ranks with norm_into_route and its router, every
    batch deferred: what the MoE block makes of it, and the reference's."""
    from arfusion.fusion import reference
    from arfusion.layers.communicator import LayerCommunicator
    from arfusion.layers.moe.router import TopKRouter
    from arfusion.layers.pending_norm import PendingNorm

    TopKRouter.norm_deferral_refusal = lambda self, x, residual, weight: None
    fusion = make_fusion(HIDDEN)
    moe = _moe_blocks()["qwen3-moe"]
    x, residual, weight = _inputs()
    comm = LayerCommunicator(1, 2, _norm(weight), _norm(weight), fusion, norm_into_route=True, router=moe.gate)
    h, summed = comm.prepare_mlp(x.clone(), residual.clone())
    normed_ref, summed_ref = reference.add_rms_norm(x * world, residual, weight, EPS)
    out = {"pending": isinstance(h, PendingNorm), "out": moe(h), "expected": moe(normed_ref), "summed": summed,
           "summed_ref": summed_ref}
    fusion.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_layer_communicator_hands_the_pending_norm_to_the_router_at_tp1_only(world_size):
    for r in run_distributed(_communicator, world_size=world_size, timeout_s=120):
        assert r["pending"] == (world_size == 1)
        torch.testing.assert_close(r["out"], r["expected"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["summed"], r["summed_ref"], rtol=1e-5, atol=1e-5)


def test_the_flag_is_off_by_default_and_reaches_the_runner_and_the_benchmark():
    from arfusion.engine import bench_one_batch
    from arfusion.engine.launch_config import runner_settings
    from arfusion.server_args import ServerArgs
    from arfusion.server_args.server_args import GPU_ONLY

    assert not ServerArgs().norm_into_route and not runner_settings(ServerArgs()).norm_into_route
    assert runner_settings(ServerArgs.from_cli(["--norm-into-route"])).norm_into_route
    assert "norm_into_route" in GPU_ONLY
    server, _ = bench_one_batch.parse_args(["--norm-into-route"])
    assert server.norm_into_route and "--norm-into-route" in bench_one_batch.build_parser().format_help()
