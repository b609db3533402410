"""A toy 4-layer TP decoder on LayerCommunicator: fusion on (torch backend) vs off."""
import pytest
import torch

from fusion import Strategy, reference
from layers.communicator import LayerCommunicator
from layers.layernorm import RMSNorm
from layers.parallel_state import get_tp_group
from tests.dist_utils import make_fusion, run_distributed
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
    group = get_tp_group()
    fusion = make_fusion(HIDDEN, enabled=fusion_enabled, backend="torch", max_tokens=max_tokens)
    model = ToyDecoder(rank, fusion)
    out = {}
    for tokens in (3, 24):
        before = group.counters.total, fusion.counts[Strategy.TORCH]
        out[tokens] = model(toy_input(tokens).clone())
        out[(tokens, "reductions")] = group.counters.total - before[0]
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


def _lookups_and_owed_reductions(rank, world_size):
    fusion = make_fusion(HIDDEN, enabled=True, backend="torch")
    model = ToyDecoder(rank, fusion)
    info = fusion.cache_info()
    before = info.hits + info.misses
    model(toy_input(5).clone())
    info = fusion.cache_info()
    lookups = info.hits + info.misses - before
    x, residual = toy_input(5), toy_input(5)
    weight = torch.ones(HIDDEN)
    errors = {}
    fusion.defer_all_reduce(x.clone(), layer_id=0)
    with pytest.raises(RuntimeError) as err:
        fusion.all_reduce_add_rms_norm(x.clone(), residual.clone(), weight, EPS, layer_id=1)
    errors["skipped"] = str(err.value)
    fusion.defer_all_reduce(x.clone(), layer_id=0)
    with pytest.raises(RuntimeError) as err:
        fusion.add_rms_norm(x.clone(), residual.clone(), weight, EPS, layer_id=2)
    errors["other_layer"] = str(err.value)
    fusion.defer_all_reduce(x.clone(), layer_id=0)
    fusion.begin_forward()  # a new forward drops what a failed one left owed
    return lookups, errors, model(toy_input(5).clone())


def test_one_decision_per_reduction_point_and_an_owed_reduction_cannot_be_skipped():
    per_rank = run_distributed(_lookups_and_owed_reductions, timeout_s=120)
    lookups, errors, out = per_rank[0]
    assert lookups == 2 * LAYERS, "prepare_mlp and postprocess_layer each look the decision up once per layer"
    assert "layer 0 was never performed" in errors["skipped"]
    assert "was not taken by the next norm (layer 2" in errors["other_layer"]
    assert_close(out, reference_decoder(5, 2))


def test_no_fusion_state_on_the_tp_group():
    import layers.parallel_state as parallel_state
    from fusion import TensorParallelGroup

    assert not hasattr(TensorParallelGroup, "fusion") and not hasattr(parallel_state, "init_allreduce_fusion")
    assert not [name for name, value in vars(parallel_state).items() if "fusion" in type(value).__name__.lower()]


def _norm_with_fusion(rank, world_size):
    fusion = make_fusion(HIDDEN, enabled=True, backend="torch")
    norm = RMSNorm(HIDDEN, EPS)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3)))
    partial = [torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(10 + r)) for r in range(world_size)]
    residual = toy_input(5)
    summed = sum(partial)
    fused, fused_residual = norm.forward_with_allreduce_fusion(partial[rank].clone(), residual.clone(), fusion, 0)
    expected, expected_residual = norm(summed.clone(), residual.clone())
    assert_close(fused, expected)
    assert_close(fused_residual, expected_residual)
    alone = norm.forward_with_allreduce_fusion(partial[rank].clone(), None, fusion, 0)
    assert isinstance(alone, torch.Tensor), "without a residual it returns what forward(x) returns: one tensor"
    assert_close(alone, norm(summed.clone()))
    return fusion.counts[Strategy.TORCH]


def test_rms_norm_forward_with_allreduce_fusion_returns_what_forward_returns():
    assert run_distributed(_norm_with_fusion, timeout_s=60) == [2, 2]
