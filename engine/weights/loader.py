"""Pick the weight format of a model path and load it: (`ModelConfig`, iterator of (HF name, tensor)).

``load_format``:
- ``auto``: a directory with config.json -> safetensors; a ``*.gguf`` file -> gguf; else an error.
- ``safetensors`` / ``gguf``: that loader, whatever the path looks like (its own errors name the path).
- ``dummy``: seeded random weights (`engine.weights.dummy`) for the config found at the path
  (a HF directory's config.json or a GGUF file's metadata).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Union

import torch

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.weights.gguf_loader import ParsedGGUF, load_gguf, parse_gguf
from arfusion.engine.weights.safetensors_loader import load_safetensors, read_hf_config

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def resolve_load_format(model_path: Union[str, Path], load_format: str = "auto") -> str:
    """The concrete format for ``model_path``: "safetensors", "gguf" or "dummy"."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; supported: {LOAD_FORMATS}")
    if load_format != "auto":
        return load_format
    path = Path(model_path)
    if not path.exists():
        raise ValueError(f"cannot infer the weight format of {str(model_path)!r}: no such file or directory")
    if path.is_dir() and (path / "config.json").is_file():
        return "safetensors"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    raise ValueError(
        f"cannot infer the weight format of {model_path!r}: load_format 'auto' needs a directory with "
        "config.json (safetensors) or a .gguf file"
    )


def _config_at(model_path: Union[str, Path], parsed: Optional[ParsedGGUF]) -> ModelConfig:
    """The config of a HF directory or a GGUF file, for dummy weights of that shape."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(parsed or path)[0]
    return read_hf_config(path)


def parse_model_file(model_path: Union[str, Path], load_format: str = "auto") -> Optional[ParsedGGUF]:
    """The model's GGUF file parsed (`parse_gguf`), for the tokenizer, the checks and the load to
    share; None for a model that is no GGUF file (a HF directory, a built-in name)."""
    path = Path(model_path)
    gguf = load_format == "gguf" or (load_format in ("auto", "dummy") and path.is_file() and path.suffix == ".gguf")
    return parse_gguf(path) if gguf else None


def load_model_weights(
    model_path: Union[str, Path], load_format: str = "auto", dtype: torch.dtype = torch.float32, seed: int = 0,
    parsed: Optional[ParsedGGUF] = None,
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The model's config and its full (unsharded) tensors under HF names, cast to ``dtype``,
    produced lazily one at a time. ``seed`` is used by ``dummy`` only; ``parsed``: the GGUF
    file `parse_model_file` parsed (None: parsed here)."""
    fmt = resolve_load_format(model_path, load_format)
    if fmt == "safetensors":
        return load_safetensors(model_path, dtype)
    if fmt == "gguf":
        return load_gguf(parsed or model_path, dtype)
    from arfusion.engine.weights.dummy import dummy_weights

    config = _config_at(model_path, parsed)
    return config, dummy_weights(config, seed=seed, dtype=dtype)
