"""A HF model directory (config.json + *.safetensors) -> (`ModelConfig`, lazy tensor iterator).

A sharded checkpoint is described by ``model.safetensors.index.json`` (``weight_map``: tensor name
-> file); without an index every ``*.safetensors`` file of the directory is read. Tensors are
opened with ``safetensors.safe_open`` and read one at a time, so at most one full tensor (plus its
cast copy) is in host memory at once. Names are passed through unchanged (HF names).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Union

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: Union[str, Path]) -> ModelConfig:
    """`ModelConfig` from ``model_dir/config.json``; FileNotFoundError naming the path if absent."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir} (expected {config_path})")
    with open(config_path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def safetensors_files(model_dir: Union[str, Path]) -> dict[Path, list[str]]:
    """Each file to read -> the tensor names it must provide (empty list: all of the file's tensors).

    With an index: the files of its ``weight_map``, each checked to exist. Without: every
    ``*.safetensors`` in the directory, sorted. Raises FileNotFoundError naming the path.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        files: dict[Path, list[str]] = {}
        for name, filename in weight_map.items():
            files.setdefault(model_dir / filename, []).append(name)
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{path} is named in {index_path} but does not exist")
        return dict(sorted(files.items()))
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return {p: [] for p in paths}


def load_safetensors(
    model_dir: Union[str, Path], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Read the config and locate the files now; yield ``(hf_name, tensor.to(dtype))`` lazily.

    A tensor the index assigns to a file that lacks it raises KeyError naming both when reached.
    """
    config = read_hf_config(model_dir)
    files = safetensors_files(model_dir)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path, names in files.items():
            with safe_open(str(path), framework="pt") as f:
                available = set(f.keys())
                for name in names or sorted(available):
                    if name not in available:
                        raise KeyError(f"tensor {name!r} is mapped to {path} by the index but is not in that file")
                    yield name, f.get_tensor(name).to(dtype)

    return config, tensors()
