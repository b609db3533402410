"""HF safetensors directories: sharded and single-file loading, dtype casts, errors, format dispatch."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.weights import load_model_weights, load_safetensors, resolve_load_format
from arfusion.engine.weights.errors import ModelFileError

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}


def hf_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 tensors (never zeros) under the HF names of HF_CONFIG's shapes."""
    g = torch.Generator().manual_seed(seed)
    h, kv, inter, vocab = 64, 2 * 16, 96, 128
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return {name: (torch.randn(shape, generator=g) + 0.5).to(torch.bfloat16) for name, shape in shapes.items()}


def write_hf_dir(path: Path, tensors: dict[str, torch.Tensor], sharded: bool = True) -> Path:
    """config.json plus either two shards and model.safetensors.index.json, or one model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for filename, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / filename))
        weight_map |= {n: filename for n in shard_names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_loads_every_tensor_exactly(tmp_path, sharded, dtype):
    tensors = hf_tensors()
    config, weights = load_safetensors(write_hf_dir(tmp_path / "m", tensors, sharded), dtype)
    assert config == ModelConfig.from_hf_dict(HF_CONFIG)
    loaded = dict(weights)
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == dtype
        assert torch.equal(loaded[name], tensor.to(dtype)), name


def test_iterator_is_lazy(tmp_path):
    """Files are read while iterating: deleting a shard after the call surfaces during iteration."""
    tensors = hf_tensors()
    model_dir = write_hf_dir(tmp_path / "m", tensors)
    _, weights = load_safetensors(model_dir)
    first_name, first = next(weights)
    assert torch.equal(first, tensors[first_name].float())
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFileError, match="model-00002-of-00002.safetensors: cannot read the file"):
        list(weights)


def test_missing_config_json(tmp_path):
    model_dir = write_hf_dir(tmp_path / "m", hf_tensors())
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelFileError, match=f"^{model_dir / 'config.json'}: no such file"):
        load_safetensors(model_dir)


def test_no_safetensors_files(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(ModelFileError, match=r"m: no \*\.safetensors files in the directory"):
        load_safetensors(model_dir)


def test_file_named_in_index_missing(tmp_path):
    model_dir = write_hf_dir(tmp_path / "m", hf_tensors())
    (model_dir / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ModelFileError, match="model-00001-of-00002.safetensors: no such file, but .* names it"):
        load_safetensors(model_dir)


def test_tensor_named_in_index_absent_from_its_file(tmp_path):
    model_dir = write_hf_dir(tmp_path / "m", hf_tensors())
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match="has no tensor 'model.layers.9.mlp.up_proj.weight', which"):
        load_safetensors(model_dir)


def test_dispatch_auto_picks_safetensors(tmp_path):
    tensors = hf_tensors(seed=3)
    model_dir = write_hf_dir(tmp_path / "m", tensors)
    assert resolve_load_format(model_dir) == "safetensors"
    config, weights = load_model_weights(model_dir, "auto", torch.bfloat16)
    assert config.num_key_value_heads == 2
    assert all(torch.equal(t, tensors[n]) for n, t in weights)


@pytest.mark.parametrize("path_kind", ["missing", "dir_without_config", "other_file"])
def test_dispatch_auto_refuses_unknown_paths(tmp_path, path_kind):
    path = {"missing": tmp_path / "nope", "dir_without_config": tmp_path, "other_file": tmp_path / "w.bin"}[path_kind]
    if path_kind == "other_file":
        path.write_bytes(b"x")
    with pytest.raises(ValueError, match="cannot infer the weight format"):
        resolve_load_format(path, "auto")
    with pytest.raises(ValueError, match="unknown load_format"):
        resolve_load_format(path, "pickle")


def test_dispatch_dummy_uses_the_directory_config(tmp_path):
    model_dir = write_hf_dir(tmp_path / "m", hf_tensors())
    config, weights = load_model_weights(model_dir, "dummy", torch.float32, seed=1)
    assert config == ModelConfig.from_hf_dict(HF_CONFIG)
    loaded = dict(weights)
    assert loaded["model.embed_tokens.weight"].shape == (128, 64)
    assert loaded["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
