"""The MoE layer and the MoE and Qwen3 models on the CPU, at TP1, TP2 and TP4 (gloo, one spawn per
TP size): the `SparseMoeBlock` of tests/test_moe_layer.py (each rank's partial sum; their sum
against its float64 reference), then the ``tiny-moe`` preset (Qwen3-MoE: q/k norm, 8 experts,
top-2), a small Mixtral and a small dense Qwen3 (head_dim 32 != hidden / heads, one KV head
replicated at TP2/TP4), fp32 with dummy weights.

Each runs three sequences: a prefill (one prompt chunked), a mixed step (a chunk after a cached
prefix plus two decodes), then greedy decode; at TP1 against a dense float64 reference written from
the HF-named weights (per-expert loops, fp64 softmax routing), at TP2 and TP4 (gloo) against TP1,
and at TP2/TP4 with fusion on (torch backend) against fusion off, bit for bit. Then HF configs and
safetensors checkpoints of the MoE architectures, and the errors of a malformed checkpoint.
"""
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from arfusion.engine.models.builtin import builtin_config
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.registry import build_model, hf_weight_shapes
from arfusion.engine.weights.dummy import dummy_weights
from arfusion.engine.weights.safetensors_loader import load_safetensors
from arfusion.layers.rotary_embedding import scaled_inv_freq
from tests import test_moe_layer as moe_layer
from tests.dist_utils import make_fusion, run_distributed
from tests.model_scenario import run_scenario

DECODE_STEPS = 8
NUM_SLOTS = 128

MIXTRAL = ModelConfig(
    architecture="MixtralForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, vocab_size=264, rope_theta=1e6, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
)
QWEN3 = ModelConfig(
    architecture="Qwen3ForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=264, rms_norm_eps=1e-6,
    rope_theta=1e6, tie_word_embeddings=True,
)
CONFIGS = {"tiny-moe": builtin_config("tiny-moe"), "mixtral": MIXTRAL, "qwen3": QWEN3}
SEED = 3


def _build(config: ModelConfig, **fusion_config):
    fusion = make_fusion(config.hidden_size, **fusion_config)
    model = build_model(config, fusion)
    model.load_weights(dummy_weights(config, seed=SEED))
    return model, fusion


def _worker(rank: int, world: int, checkpoint_dir: str) -> dict:
    result = {"block": moe_layer.block_results(), "unfused": {name: run_scenario(*_build(cfg), NUM_SLOTS, DECODE_STEPS) for name, cfg in CONFIGS.items()}}
    if world > 1:
        result["fused"] = {name: run_scenario(*_build(cfg, enabled=True, backend="torch"), NUM_SLOTS, DECODE_STEPS) for name, cfg in CONFIGS.items()}
        result["checkpoint_equal"] = _checkpoint_loads_as_dummy(checkpoint_dir)
        result["load_errors"] = _load_errors()
    return result


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    """A HF directory of the small Mixtral: config.json and two safetensors files with an index."""
    path = tmp_path_factory.mktemp("mixtral")
    hf = MIXTRAL.to_hf_dict()
    hf.pop("num_experts")
    hf.update(num_local_experts=MIXTRAL.num_experts, model_type="mixtral")
    (path / "config.json").write_text(json.dumps(hf))
    tensors = dict(dummy_weights(MIXTRAL, seed=SEED))
    names = list(tensors)
    files = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for filename, part in files.items():
        save_file({n: tensors[n] for n in part}, str(path / filename))
    index = {"weight_map": {n: f for f, part in files.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(path)


def _checkpoint_loads_as_dummy(checkpoint_dir: str) -> bool:
    config, tensors = load_safetensors(checkpoint_dir)
    assert config == MIXTRAL, config
    model = build_model(config, make_fusion(config.hidden_size))
    model.load_weights(tensors)
    dummy, _ = _build(MIXTRAL)
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), dummy.state_dict().values()))


def _load_errors() -> dict[str, str]:
    config = CONFIGS["tiny-moe"]
    weights = dict(dummy_weights(config, seed=SEED))
    expert = "model.layers.1.mlp.experts.5.down_proj.weight"
    bad = {
        "missing": {k: v for k, v in weights.items() if k != expert},
        "extra": {**weights, "model.layers.0.mlp.experts.8.up_proj.weight": torch.ones(128, 256)},
        "shape": {**weights, expert: torch.ones(256, 129)},
    }
    messages = {}
    for case, tensors in bad.items():
        with pytest.raises(ValueError) as err:
            build_model(config, make_fusion(config.hidden_size)).load_weights(tensors.items())
        messages[case] = str(err.value)
    return messages


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["tp1", "tp2", "tp4"])
def runs(request, checkpoint_dir) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_distributed(_worker, world_size=world, args=(checkpoint_dir,), timeout_s=240)


@pytest.mark.parametrize("tokens", moe_layer.TOKEN_COUNTS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_block_partial_sums_match_dense_reference(runs, renormalize, tokens):
    world, ranks = runs
    expected = moe_layer.reference(moe_layer.layer_input(tokens), moe_layer.full_weights(), renormalize)
    total = sum(r["block"]["partials"][renormalize, tokens].double() for r in ranks)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    if world > 1:
        assert not torch.allclose(ranks[0]["block"]["partials"][renormalize, tokens].double(), total), "a partial sum"
    for other in ranks[1:]:
        assert torch.equal(other["block"]["all_reduced"], ranks[0]["block"]["all_reduced"])


def test_moe_block_weight_loader_errors(runs):
    messages = runs[1][0]["block"]["load_errors"]
    assert "(32, 65)" in messages[0] and "(32, 64)" in messages[0]
    assert "expert 8 is outside" in messages[1]
    assert "'w1'" in messages[2]
    assert "does not load into this parameter" in messages[3]
    assert "(65, 32)" in messages[4] and "(64, 32)" in messages[4]


@functools.lru_cache(maxsize=None)
def _double_weights(name: str) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in dummy_weights(CONFIGS[name], seed=SEED)}


@functools.lru_cache(maxsize=None)
def reference_logits(name: str, ids: tuple[int, ...]) -> tuple[torch.Tensor, float]:
    """Dense float64 forward of a whole sequence from the HF-named dummy weights: ``([len, vocab]
    logits, the smallest gap between a token's k-th and (k+1)-th routing probability)``; cached,
    since every TP size checks the same sequences."""
    config, w = CONFIGS[name], _double_weights(name)
    n, d, heads, kv_heads = len(ids), config.head_dim, config.num_attention_heads, config.num_key_value_heads
    qk_norm = config.architecture.startswith("Qwen3")
    margin = float("inf")

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    def proj(x, name):
        return F.linear(x, w[name + ".weight"])

    def swiglu(x, gate, up, down):
        return proj(F.silu(proj(x, gate)) * proj(x, up), down)

    def moe(x, block):
        nonlocal margin
        k = config.num_experts_per_tok
        probs = torch.softmax(proj(x, block + ".gate"), dim=-1)
        top = probs.topk(k + 1 if k < config.num_experts else k, dim=-1)
        if k < config.num_experts:
            margin = min(margin, (top.values[:, k - 1] - top.values[:, k]).min().item())
        values, experts = top.values[:, :k], top.indices[:, :k]
        values = values / values.sum(-1, keepdim=True) if config.norm_topk_prob else values
        names = ("w1", "w3", "w2") if config.architecture == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for value, e in zip(values[t], experts[t].tolist()):
                out[t] += value * swiglu(x[t], *(f"{block}.experts.{e}.{p}" for p in names))
        return out

    angle = torch.arange(n, dtype=torch.float64)[:, None] * scaled_inv_freq(d, config.rope_theta, config.rope_scaling).double()
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(x):  # HF's rotate_half form
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][list(ids)]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k = proj(h, p + "self_attn.q_proj").view(n, heads, d), proj(h, p + "self_attn.k_proj").view(n, kv_heads, d)
        if qk_norm:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k).repeat_interleave(heads // kv_heads, 1)
        v = proj(h, p + "self_attn.v_proj").view(n, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        x = x + proj(attn.reshape(n, heads * d), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if config.architecture == "MixtralForCausalLM":
            x = x + moe(h, p + "block_sparse_moe")
        elif config.is_moe:
            x = x + moe(h, p + "mlp")
        else:
            x = x + swiglu(h, p + "mlp.gate_proj", p + "mlp.up_proj", p + "mlp.down_proj")
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T, margin


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_dense_float64_reference(runs, name):
    world, ranks = runs
    run = ranks[0]["unfused"][name]
    references = [reference_logits(name, tuple(seq[:-1])) for seq in run["tokens"]]
    assert min(margin for _, margin in references) > 1e-5, "no near-tie in the routing the fp32 model could flip"
    expected = torch.stack([references[s][0][pos] for s, pos in run["rows"]]).float()
    torch.testing.assert_close(run["logits"], expected, rtol=1e-5, atol=1e-5)
    for other in ranks[1:]:
        assert torch.equal(other["unfused"][name]["logits"], run["logits"]), "gathered logits equal on every rank"


TP_N = pytest.mark.parametrize("runs", [2, 4], ids=["tp2", "tp4"], indirect=True)


@TP_N
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fusion_on_equals_off_bit_for_bit(runs, name):
    world, ranks = runs
    unfused, fused = ranks[0]["unfused"][name], ranks[0]["fused"][name]
    assert fused["tokens"] == unfused["tokens"]
    assert torch.equal(fused["logits"], unfused["logits"])
    layers = CONFIGS[name].num_hidden_layers
    assert unfused["all_reduces"] == fused["all_reduces"] == unfused["forwards"] * (1 + 2 * layers)
    assert unfused["fused"] == 0 and fused["fused"] == unfused["forwards"] * 2 * layers


@TP_N
def test_safetensors_checkpoint_loads_the_same_model(runs):
    world, ranks = runs
    assert all(r["checkpoint_equal"] for r in ranks)


@TP_N
@pytest.mark.parametrize("case,needles", [
    ("missing", ["missing 1 tensor", "model.layers.1.mlp.experts.5.down_proj.weight"]),
    ("extra", ["unexpected", "model.layers.0.mlp.experts.8.up_proj.weight"]),
    ("shape", ["model.layers.1.mlp.experts.5.down_proj.weight", "(256, 129)", "(256, 128)"]),
])
def test_load_errors_name_the_tensor(runs, case, needles):
    world, ranks = runs
    message = ranks[0]["load_errors"][case]
    for needle in needles:
        assert needle in message, message


QWEN3_MOE_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": [151643, 151645],
}
MIXTRAL_HF = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.mark.parametrize("hf,preset", [(QWEN3_MOE_HF, "qwen3-30b-a3b"), (MIXTRAL_HF, "mixtral-8x7b")])
def test_hf_configs_of_the_presets(hf, preset):
    config = ModelConfig.from_hf_dict(hf)
    assert config == builtin_config(preset)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    shapes = hf_weight_shapes(config)
    experts = config.num_experts * config.num_hidden_layers * 3 * config.hidden_size * config.moe_intermediate_size
    attention = config.num_hidden_layers * 2 * config.hidden_size * config.head_dim * (
        config.num_attention_heads + config.num_key_value_heads)
    assert sum(torch.Size(s).numel() for n, s in shapes.items() if ".experts." in n) == experts
    assert sum(torch.Size(s).numel() for n, s in shapes.items() if "_proj." in n and "self_attn" in n) == attention


@pytest.mark.parametrize("change,needle", [
    ({"mlp_only_layers": [3]}, "dense MLP layers"),
    ({"decoder_sparse_step": 2}, "dense MLP layers"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
])
def test_unsupported_moe_configs_are_refused(change, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_dict({**QWEN3_MOE_HF, **change})
