"""The GGUF mapping of the MoE and Qwen3 parts (engine/weights/gguf_moe_names.py) on small files
written with ``gguf.GGUFWriter`` as llama.cpp lays them out: a ``qwen3moe`` file and a
``llama`` file with experts (Mixtral), each with the HF dummy weights of a 2-layer model, the
experts stacked into ``ffn_{gate,up,down}_exps``. Read back with ``GGUFReader``: the config
fields from the metadata, and every MoE / q-k-norm tensor mapped to the HF tensors it was
written from, bit for bit.
"""
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.weights.dummy import dummy_weights
from arfusion.engine.weights.gguf_moe_names import hf_moe_architecture, hf_moe_tensors, is_moe_tensor, moe_config_fields
from arfusion.engine.weights.gguf_names import field_value

QWEN3_MOE = ModelConfig(
    architecture="Qwen3MoeForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=100, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
)
MIXTRAL = ModelConfig(
    architecture="MixtralForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=48, vocab_size=100, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=48, norm_topk_prob=True,
)
CASES = {"qwen3moe": QWEN3_MOE, "llama": MIXTRAL}


def _stacked(weights: dict[str, torch.Tensor], block: str, proj: str, experts: int) -> np.ndarray:
    return torch.stack([weights[f"{block}.experts.{e}.{proj}.weight"] for e in range(experts)]).numpy()


def write_moe_gguf(path: str, gguf_arch: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A GGUF of ``config``'s MoE and q/k-norm tensors (with the metadata the mapping reads);
    returns the HF tensors they were made from."""
    weights = dict(dummy_weights(config, seed=1))
    writer = GGUFWriter(path, gguf_arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if gguf_arch == "llama":
        writer.add_feed_forward_length(config.moe_intermediate_size)
    else:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_feed_forward_length(config.intermediate_size)
    mixtral = config.architecture == "MixtralForCausalLM"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in range(config.num_hidden_layers):
        block = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}"
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", weights[f"{block}.gate.weight"].numpy())
        for gguf_base, proj in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), names):
            writer.add_tensor(f"blk.{i}.{gguf_base}.weight", _stacked(weights, block, proj, config.num_experts))
        if not mixtral:
            for norm in ("q_norm", "k_norm"):
                writer.add_tensor(f"blk.{i}.attn_{norm}.weight", weights[f"model.layers.{i}.self_attn.{norm}.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.mark.parametrize("gguf_arch", list(CASES))
def test_config_fields_and_tensors_round_trip(tmp_path, gguf_arch):
    config = CASES[gguf_arch]
    path = str(tmp_path / "moe.gguf")
    weights = write_moe_gguf(path, gguf_arch, config)
    reader = GGUFReader(path)

    def get(key: str, default: Any = ...) -> Any:
        return field_value(reader, key.format(arch=gguf_arch), default, path)

    assert moe_config_fields(get, gguf_arch) == {
        "architecture": config.architecture, "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok, "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": True,
    }
    mapped: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        assert is_moe_tensor(t.name), t.name
        for name, tensor in hf_moe_tensors(t.name, torch.from_numpy(np.array(t.data)), config.architecture):
            assert name not in mapped
            mapped[name] = tensor
    expected = {n: w for n, w in weights.items() if ".experts." in n or n.endswith((".gate.weight", "q_norm.weight", "k_norm.weight"))}
    assert mapped.keys() == expected.keys()
    for name, tensor in mapped.items():
        assert torch.equal(tensor, expected[name]), name


def test_dense_names_and_architectures_are_left_to_the_dense_mapping():
    for name in ("blk.0.ffn_gate.weight", "blk.3.attn_q.weight", "token_embd.weight", "blk.1.ffn_norm.weight"):
        assert not is_moe_tensor(name)
        with pytest.raises(ValueError, match="not a GGUF MoE"):
            hf_moe_tensors(name, torch.ones(2, 2), "Qwen3MoeForCausalLM")
    assert hf_moe_architecture("llama", 0) is None and hf_moe_architecture("qwen2", 0) is None
    assert hf_moe_architecture("llama", 8) == "MixtralForCausalLM"
    assert moe_config_fields(lambda key, default=None: default, "qwen3") == {"architecture": "Qwen3ForCausalLM"}


# HF name -> llama.cpp base name of the dense parts (the MoE parts are stacked by write_moe_gguf's rule)
_DENSE = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_whole_qwen3_moe(path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A complete qwen3moe GGUF (F32) of ``config``'s dummy weights, laid out as llama.cpp's
    converter writes it; returns the HF tensors."""
    from tests.gguf_files import write_gguf

    weights = dict(dummy_weights(config, seed=1))
    meta = {
        "qwen3moe.block_count": config.num_hidden_layers, "qwen3moe.context_length": 4096,
        "qwen3moe.embedding_length": config.hidden_size, "qwen3moe.attention.head_count": config.num_attention_heads,
        "qwen3moe.attention.head_count_kv": config.num_key_value_heads,
        "qwen3moe.attention.key_length": config.head_dim, "qwen3moe.attention.value_length": config.head_dim,
        "qwen3moe.rope.freq_base": 1e6, "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3moe.expert_count": config.num_experts, "qwen3moe.expert_used_count": config.num_experts_per_tok,
        "qwen3moe.expert_feed_forward_length": config.moe_intermediate_size,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(config.vocab_size)],
    }
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"].numpy()}
    for i in range(config.num_hidden_layers):
        for hf, base in _DENSE.items():
            tensors[f"blk.{i}.{base}.weight"] = weights[f"model.layers.{i}.{hf}.weight"].numpy()
        block = f"model.layers.{i}.mlp"
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = weights[f"{block}.gate.weight"].numpy()
        for base, proj in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), ("gate_proj", "up_proj", "down_proj")):
            tensors[f"blk.{i}.{base}.weight"] = _stacked(weights, block, proj, config.num_experts)
    tensors |= {"output_norm.weight": weights["model.norm.weight"].numpy(), "output.weight": weights["lm_head.weight"].numpy()}
    write_gguf(path, "qwen3moe", meta, {name: (data, None) for name, data in tensors.items()})
    return weights


def test_a_whole_moe_gguf_loads_into_the_model(tmp_path):
    from arfusion.engine.weights.gguf_loader import load_gguf

    weights = write_whole_qwen3_moe(tmp_path / "qwen3moe.gguf", QWEN3_MOE)
    config, tensors = load_gguf(tmp_path / "qwen3moe.gguf")
    assert (config.architecture, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.head_dim, config.intermediate_size) == ("Qwen3MoeForCausalLM", 4, 2, 48, 32, 48)
    loaded = dict(tensors)
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
