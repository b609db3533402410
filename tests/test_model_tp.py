"""The tensor-parallel Llama-family model: TP1 and TP2 against a dense float64 reference and
against each other, fused against unfused all-reduces, and weight-loading errors.

Two small models (fp32, dummy weights): a Llama with Llama-3 rope scaling (which matters at
these positions) and a Qwen2-style one (q/k/v bias, tied embeddings, one KV head replicated at
TP2). Each runs a batch of three sequences of different lengths: a prefill (one prompt
chunked), a mixed step (a chunk after a cached prefix plus two decodes), then greedy decode.
"""
import pytest
import torch
import torch.nn.functional as F

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.registry import build_model
from arfusion.engine.weights.dummy import dummy_weights

from arfusion.layers.rotary_embedding import scaled_inv_freq
from tests.dist_utils import make_fusion, run_distributed
from tests.model_scenario import run_scenario

DECODE_STEPS = 32
NUM_SLOTS = 256

LLAMA = ModelConfig(
    architecture="LlamaForCausalLM", hidden_size=128, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=4, intermediate_size=256, vocab_size=264, rope_theta=10000.0,
    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16},
)
QWEN = ModelConfig(
    architecture="Qwen2ForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=1, intermediate_size=128, vocab_size=264, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=True, attention_bias=True,
)
CONFIGS = {"llama": LLAMA, "qwen": QWEN}


def _run(config: ModelConfig, **fusion_config) -> dict:
    fusion = make_fusion(config.hidden_size, **fusion_config)
    model = build_model(config, fusion)
    model.load_weights(dummy_weights(config, seed=3))
    return run_scenario(model, fusion, NUM_SLOTS, DECODE_STEPS)


def _tp_worker(rank: int, world: int) -> dict:
    unfused = {name: _run(cfg) for name, cfg in CONFIGS.items()}
    if world == 1:
        return {"unfused": unfused}
    fused = {}
    for name, cfg in CONFIGS.items():
        fused[name] = _run(cfg, enabled=True, backend="torch")
    return {"unfused": unfused, "fused": fused, "load_errors": _load_errors()}


def _build_unloaded(config: ModelConfig):
    return build_model(config, make_fusion(config.hidden_size))


def _load_errors() -> dict[str, str]:
    weights = dict(dummy_weights(LLAMA, seed=3))
    bad = {
        "missing": {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "extra": {**weights, "model.layers.0.mlp.extra_proj.weight": torch.ones(2, 2)},
        "shape": {**weights, "model.layers.2.self_attn.k_proj.weight": torch.ones(64, 129)},
    }
    messages = {}
    for case, tensors in bad.items():
        with pytest.raises(ValueError) as err:
            _build_unloaded(LLAMA).load_weights(tensors.items())
        messages[case] = str(err.value)
    skipped = {**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    _build_unloaded(LLAMA).load_weights(skipped.items())
    qwen = dict(dummy_weights(QWEN, seed=3))
    _build_unloaded(QWEN).load_weights({**qwen, "lm_head.weight": qwen["model.embed_tokens.weight"]}.items())
    return messages


@pytest.fixture(scope="module")
def tp1() -> dict:
    return run_distributed(_tp_worker, world_size=1, timeout_s=60)[0]


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_distributed(_tp_worker, world_size=2, timeout_s=90)


@pytest.fixture(scope="module")
def tp4() -> list[dict]:
    """4 ranks over gloo: what this machine can show of TP4 (KV heads replicated for Qwen)."""
    return run_distributed(_tp_worker, world_size=4, timeout_s=180)


def _reference_logits(config: ModelConfig, ids: list[int]) -> torch.Tensor:
    """Dense float64 forward over a whole sequence, from the HF-named weights: ``[len, vocab]``."""
    w = {k: v.double() for k, v in dummy_weights(config, seed=3)}
    n, d = len(ids), config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    def proj(x, name):
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    angle = torch.arange(n, dtype=torch.float64)[:, None] * scaled_inv_freq(d, config.rope_theta, config.rope_scaling).double()
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(x):  # HF's rotate_half form
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][ids]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope(proj(h, p + "self_attn.q_proj").view(n, heads, d))
        k = rope(proj(h, p + "self_attn.k_proj").view(n, kv_heads, d)).repeat_interleave(heads // kv_heads, 1)
        v = proj(h, p + "self_attn.v_proj").view(n, kv_heads, d).repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        x = x + proj(attn.reshape(n, heads * d), p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + proj(F.silu(proj(h, p + "mlp.gate_proj")) * proj(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp1_matches_dense_reference(tp1, name):
    run = tp1["unfused"][name]
    reference = {s: _reference_logits(CONFIGS[name], seq[:-1]) for s, seq in enumerate(run["tokens"])}
    expected = torch.stack([reference[s][pos] for s, pos in run["rows"]]).float()
    torch.testing.assert_close(run["logits"], expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("tp", ["tp2", "tp4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp_n_equals_tp1(request, tp1, tp, name):
    single, ranks = tp1["unfused"][name], [r["unfused"][name] for r in request.getfixturevalue(tp)]
    assert ranks[0]["tokens"] == single["tokens"]
    torch.testing.assert_close(ranks[0]["logits"], single["logits"], rtol=1e-5, atol=2e-6)
    for other in ranks[1:]:
        assert torch.equal(ranks[0]["logits"], other["logits"]), "gathered logits are identical on every rank"


@pytest.mark.parametrize("tp", ["tp2", "tp4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fusion_changes_nothing_but_where_reductions_run(request, tp, name):
    runs = request.getfixturevalue(tp)
    unfused, fused = runs[0]["unfused"][name], runs[0]["fused"][name]
    layers = CONFIGS[name].num_hidden_layers
    assert fused["tokens"] == unfused["tokens"], "greedy tokens over 32 decode steps"
    torch.testing.assert_close(fused["logits"], unfused["logits"], rtol=1e-6, atol=1e-6)
    expected_reductions = unfused["forwards"] * (1 + 2 * layers)  # embedding + o_proj and down_proj per layer
    assert unfused["all_reduces"] == expected_reductions and unfused["fused"] == 0
    assert fused["all_reduces"] == expected_reductions
    assert fused["fused"] == unfused["forwards"] * 2 * layers, "every layer reduction went through the fused op"


@pytest.mark.parametrize("case,needles", [
    ("missing", ["missing 1 tensor", "model.layers.1.mlp.up_proj.weight"]),
    ("extra", ["unexpected", "model.layers.0.mlp.extra_proj.weight"]),
    ("shape", ["model.layers.2.self_attn.k_proj.weight", "(64, 129)", "(64, 128)"]),
])
def test_load_weights_errors_name_the_tensor(tp2, case, needles):
    message = tp2[0]["load_errors"][case]
    for needle in needles:
        assert needle in message, message
