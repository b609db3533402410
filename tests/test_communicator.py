"""A toy 4-layer TP decoder on LayerCommunicator: fusion on (torch backend) vs off."""
import pytest
import torch

from arfusion.fusion import FusionInputError, PartialSum, Strategy, reference
from arfusion.layers.communicator import LayerCommunicator
from arfusion.layers.layernorm import RMSNorm
from arfusion.layers.parallel_state import get_tp_group
from tests.dist_utils import AllReduceCounter, make_fusion, run_distributed
from tests.tolerances import assert_close

HIDDEN, LAYERS, EPS = 64, 4, 1e-6


def toy_weights(rank: int):
    """Per layer: this rank's attention and MLP shards (its partial sums), and shared norm weights."""
    g = torch.Generator().manual_seed(100 + rank)
    shared = torch.Generator().manual_seed(7)
    layers = []
    for _ in range(LAYERS):
        layers.append({
            "attn": torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5,
            "mlp": torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5,
            "ln1": 1 + 0.1 * torch.randn(HIDDEN, generator=shared),
            "ln2": 1 + 0.1 * torch.randn(HIDDEN, generator=shared),
        })
    final = 1 + 0.1 * torch.randn(HIDDEN, generator=shared)
    return layers, final


def toy_input(tokens: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))


class ToyDecoder(torch.nn.Module):
    """Each layer: attention = normed @ W_attn[rank] (partial), MLP = normed @ W_mlp[rank] (partial)."""

    def __init__(self, rank: int, fusion) -> None:
        super().__init__()
        self.weights, final = toy_weights(rank)
        self.norms = []
        self.comms = []
        for i, w in enumerate(self.weights):
            ln1, ln2 = RMSNorm(HIDDEN, EPS), RMSNorm(HIDDEN, EPS)
            ln1.weight.data.copy_(w["ln1"])
            ln2.weight.data.copy_(w["ln2"])
            self.comms.append(LayerCommunicator(i, LAYERS, ln1, ln2, fusion))
        self.final_norm = RMSNorm(HIDDEN, EPS)
        self.final_norm.weight.data.copy_(final)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        residual = None
        for w, comm in zip(self.weights, self.comms):
            h, residual = comm.prepare_attn(h, residual)
            h = h @ w["attn"]
            h, residual = comm.prepare_mlp(h, residual)
            h = h @ w["mlp"]
            h, residual = comm.postprocess_layer(h, residual)
        return self.comms[-1].prepare_final_norm(h, residual, self.final_norm)


def reference_decoder(tokens: int, world_size: int) -> torch.Tensor:
    """Single-process ground truth: the sums over ranks written out."""
    per_rank = [toy_weights(r)[0] for r in range(world_size)]
    final = toy_weights(0)[1]
    h, residual = toy_input(tokens), None
    for i in range(LAYERS):
        if residual is None:
            residual, h = h, reference.rms_norm(h, per_rank[0][i]["ln1"], EPS)
        else:
            h, residual = reference.add_rms_norm(h, residual, per_rank[0][i]["ln1"], EPS)
        attn = sum(h @ per_rank[r][i]["attn"] for r in range(world_size))
        h, residual = reference.add_rms_norm(attn, residual, per_rank[0][i]["ln2"], EPS)
        h = sum(h @ per_rank[r][i]["mlp"] for r in range(world_size))
    return reference.add_rms_norm(h, residual, final, EPS)[0]


@torch.inference_mode()
def _run_toy(rank, world_size, fusion_enabled, max_tokens):
    counter = AllReduceCounter(get_tp_group())
    fusion = make_fusion(HIDDEN, enabled=fusion_enabled, backend="torch", max_tokens=max_tokens)
    model = ToyDecoder(rank, fusion)
    out = {}
    for tokens in (3, 24):
        before = counter.total, fusion.counts[Strategy.TORCH]
        out[tokens] = model(toy_input(tokens).clone())
        out[(tokens, "reductions")] = counter.total - before[0]
        out[(tokens, "fused")] = fusion.counts[Strategy.TORCH] - before[1]
        assert_close(out[tokens], reference_decoder(tokens, world_size))
    out["status"] = fusion.status()
    return out


@pytest.mark.parametrize("world_size,max_tokens", [(2, 2048), (2, 16), (4, 16)])  # 16: 3 tokens fuse, 24 fall back
def test_fusion_on_equals_off_with_the_same_reductions(world_size, max_tokens):
    on = run_distributed(_run_toy, world_size=world_size, args=(True, max_tokens), timeout_s=120)
    off = run_distributed(_run_toy, world_size=world_size, args=(False, max_tokens), timeout_s=120)
    for tokens in (3, 24):
        for rank in range(world_size):
            assert_close(on[rank][tokens], off[rank][tokens])
            assert on[rank][(tokens, "reductions")] == off[rank][(tokens, "reductions")] == 2 * LAYERS
            assert off[rank][(tokens, "fused")] == 0
    assert on[0][(3, "fused")] == 2 * LAYERS, "every reduction point fuses when the decision says so"
    expected_fused_24 = 2 * LAYERS if max_tokens >= 24 else 0
    assert on[0][(24, "fused")] == expected_fused_24
    assert on[0]["status"]["active"] and not off[0]["status"]["active"]


def _lookups_and_partial_sums(rank, world_size):
    fusion = make_fusion(HIDDEN, enabled=True, backend="torch")
    model = ToyDecoder(rank, fusion)
    info = fusion.cache_info()
    before = info.hits + info.misses
    model(toy_input(5).clone())
    info = fusion.cache_info()
    lookups = info.hits + info.misses - before
    x, residual = toy_input(5), toy_input(5)
    comm = model.comms[2]
    errors = {}

    def refused(name, call, kind=FusionInputError):
        with pytest.raises(kind) as err:
            call()
        errors[name] = str(err.value)

    partial, _ = model.comms[0].postprocess_layer(x.clone(), residual.clone())
    assert isinstance(partial, PartialSum) and partial.layer_id == 0 and partial.op is fusion
    refused("as a reduced input", lambda: comm.prepare_mlp(partial, residual.clone()))
    refused("to a later layer", lambda: comm.prepare_attn(partial, residual.clone()))
    refused("to a torch op", lambda: partial @ x, TypeError)
    model.comms[1].prepare_attn(partial, residual.clone())
    refused("twice", lambda: model.comms[1].prepare_attn(partial, residual.clone()))
    return lookups, errors, model(toy_input(5).clone())


def test_a_deferred_reduction_is_a_value_that_cannot_be_misused():
    per_rank = run_distributed(_lookups_and_partial_sums, timeout_s=120)
    lookups, errors, out = per_rank[0]
    assert lookups == 2 * LAYERS, "one cached lookup per reduction: the attention's and the MLP's, by their norms"
    assert "a PartialSum is reduced by the norm that takes it" in errors["as a reduced input"]
    assert "reached the norm after layer 1" in errors["to a later layer"]
    assert "PartialSum" in errors["to a torch op"]
    assert "already reduced" in errors["twice"]
    assert_close(out, reference_decoder(5, 2))


def test_no_fusion_state_on_the_tp_group():
    import arfusion.layers.parallel_state as parallel_state
    from arfusion.fusion import TensorParallelGroup

    assert not hasattr(TensorParallelGroup, "fusion") and not hasattr(parallel_state, "init_allreduce_fusion")
    assert not [name for name, value in vars(parallel_state).items() if "fusion" in type(value).__name__.lower()]
