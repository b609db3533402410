"""Small model files that load, and the broken variants of them the model-file tests refuse.

`good_gguf`: an all-F32 llama GGUF (tests/gguf_files.py's shapes) with a byte-level BPE
vocabulary, so that the server can build its tokenizer from the file. `good_hf_dir`: a HF
directory (config.json, tokenizer.json, one model.safetensors) of a 2-layer Llama of hidden 64.
Values are seeded normals (never zeros). Each entry of `CASES` writes one broken model and
says which file an error must name and which words it must hold.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from gguf import Keys
from safetensors.torch import save_file

from arfusion.engine.tokenizers.tokenizer import build_tiny_tokenizer
from tests.gguf_files import bpe_metadata, model_metadata, shapes, train_bpe, write_gguf

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 512,
}
NAN_COUNT = 1024


def gguf_tensors(vocab: int, seed: int = 0) -> dict[str, tuple[np.ndarray, None]]:
    """Every weight of the test llama model (GGUF names), float32, seeded."""
    rng = np.random.default_rng(seed)
    return {base + ".weight": ((rng.standard_normal(shape) * 0.1 + base.endswith("norm")).astype(np.float32), None)
            for base, shape in shapes(vocab).items()}


def good_gguf(path: Path, arch: str = "llama", drop_key: str = "", change: Optional[dict] = None) -> Path:
    """The loadable GGUF, or a variant: ``arch`` as general.architecture, metadata key
    ``drop_key`` ({arch}-templated) left out, tensors replaced or removed (None) by ``change``."""
    bpe = train_bpe()
    meta = model_metadata(arch) | bpe_metadata(bpe)
    meta.pop(drop_key.format(arch=arch), None)
    tensors = gguf_tensors(bpe.get_vocab_size()) | (change or {})
    return write_gguf(path, arch, meta, {name: t for name, t in tensors.items() if t is not None})


def hf_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight of HF_CONFIG's model under its HF name, float32, seeded."""
    from arfusion.engine.models.config import ModelConfig
    from arfusion.engine.models.registry import hf_weight_shapes

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.1 + name.endswith("norm.weight")
            for name, shape in hf_weight_shapes(ModelConfig.from_hf_dict(HF_CONFIG)).items()}


def good_hf_dir(path: Path, config_text: Optional[str] = None,
                change: Optional[dict[str, Optional[torch.Tensor]]] = None) -> Path:
    """The loadable HF directory, or a variant: config.json's text, tensors replaced or removed (None)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(HF_CONFIG) if config_text is None else config_text)
    build_tiny_tokenizer().tokenizer.save(str(path / "tokenizer.json"))
    tensors = hf_tensors() | (change or {})
    save_file({name: t for name, t in tensors.items() if t is not None}, str(path / "model.safetensors"))
    return path


def cut(path: Path, size: int) -> Path:
    """Truncate the file ``path`` to ``size`` bytes (in place); returns it."""
    path.write_bytes(path.read_bytes()[:size])
    return path


def with_nans(shape: tuple[int, ...], count: int, seed: int = 1) -> np.ndarray:
    """Seeded normals with ``count`` NaNs at seeded positions."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(np.float32)
    values.reshape(-1)[rng.choice(values.size, count, replace=False)] = np.nan
    return values


@dataclass(frozen=True)
class BrokenModel:
    model: Path  # what --model-path gets
    named: Path  # the file the error must name
    words: tuple[str, ...]  # what the error must say


def _gguf_cut(size: Callable[[int], int]) -> Callable[[Path], BrokenModel]:
    def make(d: Path) -> BrokenModel:
        path = good_gguf(d / "m.gguf")
        return BrokenModel(cut(path, size(path.stat().st_size)), path, ("truncated",))
    return make


def _wrong_magic(d: Path) -> BrokenModel:
    path = good_gguf(d / "m.gguf")
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    return BrokenModel(path, path, ("not a GGUF file", "GGML"))


def _gguf(words: tuple[str, ...], **variant) -> Callable[[Path], BrokenModel]:
    def make(d: Path) -> BrokenModel:
        path = good_gguf(d / "m.gguf", **variant)
        return BrokenModel(path, path, words)
    return make


def _config(text: str, words: tuple[str, ...]) -> Callable[[Path], BrokenModel]:
    def make(d: Path) -> BrokenModel:
        model = good_hf_dir(d / "m", config_text=text)
        return BrokenModel(model, model / "config.json", words)
    return make


def _safetensors(words: tuple[str, ...], change: Optional[dict] = None, size: Optional[Callable[[int], int]] = None
                 ) -> Callable[[Path], BrokenModel]:
    def make(d: Path) -> BrokenModel:
        model = good_hf_dir(d / "m", change=change)
        file = model / "model.safetensors"
        if size is not None:
            cut(file, size(file.stat().st_size))
        return BrokenModel(model, file, words)
    return make


_NO_HIDDEN = {k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}
_NAN_Q = torch.from_numpy(with_nans((64, 64), 10))
_INF_Q = _NAN_Q.nan_to_num(nan=float("inf"))
# name -> writer of a broken model into a directory
CASES: dict[str, Callable[[Path], BrokenModel]] = {
    "gguf cut to 64 bytes": _gguf_cut(lambda size: 64),
    "gguf cut in half": _gguf_cut(lambda size: size // 2),
    "gguf one byte short": _gguf_cut(lambda size: size - 1),
    "wrong magic": _wrong_magic,
    "gguf unknown architecture": _gguf(("unknown GGUF architecture 'falcon'",), arch="falcon"),
    "gguf missing metadata key": _gguf(("llama.block_count", "missing"), drop_key=Keys.LLM.BLOCK_COUNT),
    "gguf tensor shape mismatch": _gguf(("has shape", "blk.0.ffn_up.weight"),
                                        change={"blk.0.ffn_up.weight": (with_nans((520, 256), 0), None)}),
    "gguf missing tensor": _gguf(("missing 1 tensor", "model.layers.1.mlp.down_proj.weight"),
                                 change={"blk.1.ffn_down.weight": None}),
    "gguf nan weights": _gguf(("non-finite", "'blk.0.attn_q.weight'", f"{NAN_COUNT} NaN"),
                              change={"blk.0.attn_q.weight": (with_nans((256, 256), NAN_COUNT), None)}),
    "config.json {}": _config("{}", ("no 'architectures'",)),
    "config.json missing key": _config(json.dumps(_NO_HIDDEN), ("missing key 'hidden_size'",)),
    "config.json unknown architecture": _config(json.dumps(HF_CONFIG | {"architectures": ["FalconForCausalLM"]}),
                                                ("unknown architecture 'FalconForCausalLM'",)),
    "config.json invalid JSON": _config(json.dumps(HF_CONFIG)[:-9], ("not valid JSON", "line 1")),
    "config.json wrong type": _config(json.dumps(HF_CONFIG | {"num_attention_heads": "4"}),
                                      ("num_attention_heads must be a positive integer",)),
    "safetensors cut in half": _safetensors(("truncated",), size=lambda size: size // 2),
    "safetensors cut to 64 bytes": _safetensors(("truncated", "header"), size=lambda size: 64),
    "safetensors tensor shape mismatch": _safetensors(("has shape", "model.layers.0.mlp.up_proj.weight"),
                                                      change={"model.layers.0.mlp.up_proj.weight": torch.from_numpy(with_nans((96, 65), 0))}),
    "safetensors missing tensor": _safetensors(("missing 1 tensor", "model.norm.weight"),
                                               change={"model.norm.weight": None}),
    "safetensors inf weights": _safetensors(("non-finite", "'model.layers.1.self_attn.q_proj.weight'", "10 infinite"),
                                            change={"model.layers.1.self_attn.q_proj.weight": _INF_Q}),
}
# found only by reading the tensors' values: on every rank, during the load
FOUND_WHILE_LOADING = ("gguf nan weights", "safetensors inf weights")
