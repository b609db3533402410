"""A HF model directory (config.json + *.safetensors) -> (`ModelConfig`, lazy tensor iterator).

A sharded checkpoint is described by ``model.safetensors.index.json`` (``weight_map``: tensor name
-> file); without an index every ``*.safetensors`` file of the directory is read. Before any
tensor is read, the config and every file's header are checked (`safetensors_header`: complete,
tensor names and shapes the model's, none missing). Tensors are then opened with
``safetensors.safe_open`` and read one at a time, so at most one full tensor (plus its cast copy)
is in host memory at once. Names are passed through unchanged (HF names). Every problem is a
`ModelFileError` naming the file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Union

import torch
from safetensors import SafetensorError, safe_open

from arfusion.engine.models.checkpoint_tensors import CheckpointTensors
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.registry import hf_weight_shapes
from arfusion.engine.weights.errors import ModelFileError, finite_cast, truncation

INDEX_FILE = "model.safetensors.index.json"
LENGTH_BYTES = 8  # a safetensors file starts with its JSON header's length, u64 little-endian
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit: a longer "header" is not one


def read_json(path: Path) -> Any:
    """The JSON value in ``path``; `ModelFileError` naming it if it is absent, unreadable or not JSON."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ModelFileError(path, "no such file") from None
    except OSError as exc:
        raise ModelFileError(path, f"cannot read the file: {exc.strerror or exc}") from None
    try:
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, or bytes that are no Unicode text
        raise ModelFileError(path, f"not valid JSON: {exc}") from None


def read_hf_config(model_dir: Union[str, Path]) -> ModelConfig:
    """`ModelConfig` from ``model_dir/config.json``; `ModelFileError` naming config.json when it
    is absent, not a JSON object, or not a valid config (no or an unknown architecture, missing
    keys, a value of the wrong type)."""
    config_path = Path(model_dir) / "config.json"
    d = read_json(config_path)
    if not isinstance(d, dict):
        raise ModelFileError(config_path, f"not a JSON object but a JSON {type(d).__name__}")
    try:
        return ModelConfig.from_hf_dict(d)
    except (ValueError, TypeError) as exc:
        raise ModelFileError(config_path, str(exc)) from None


def safetensors_files(model_dir: Union[str, Path]) -> dict[Path, list[str]]:
    """Each file to read -> the tensor names it must provide (empty list: all of the file's tensors).

    With an index: the files of its ``weight_map``, each checked to exist. Without: every
    ``*.safetensors`` in the directory, sorted. `ModelFileError` naming the path otherwise.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFileError(index_path, "has no weight_map")
        files: dict[Path, list[str]] = {}
        for name, filename in weight_map.items():
            files.setdefault(model_dir / filename, []).append(name)
        for path in files:
            if not path.is_file():
                raise ModelFileError(path, f"no such file, but {index_path} names it")
        return dict(sorted(files.items()))
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ModelFileError(model_dir, "no *.safetensors files in the directory")
    return {p: [] for p in paths}


def safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the header of the safetensors file ``path``: its 8-byte length,
    then that many bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
    offsets counted from the end of the header). `ModelFileError` naming the file when it is
    too short for its header or for its tensors' data (truncated), or is no safetensors file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < LENGTH_BYTES:
                raise ModelFileError(path, f"truncated: {size} bytes, shorter than the {LENGTH_BYTES}-byte header length")
            f.seek(0)
            length = int.from_bytes(f.read(LENGTH_BYTES), "little")
            if length > MAX_HEADER_BYTES:
                raise ModelFileError(path, f"not a safetensors file: its first {LENGTH_BYTES} bytes give a header of {length} bytes")
            if LENGTH_BYTES + length > size:
                raise ModelFileError(path, f"truncated: the file has {size} bytes, its header alone needs {LENGTH_BYTES + length}")
            raw = f.read(length)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read the file: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
        shapes = {name: tuple(int(d) for d in info["shape"]) for name, info in header.items() if name != "__metadata__"}
        ends = [(LENGTH_BYTES + length + int(info["data_offsets"][1]), name)
                for name, info in header.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ModelFileError(path, f"not a safetensors file: its header is not a safetensors JSON header ({exc!r})") from None
    problem = truncation(size, ends)
    if problem:
        raise ModelFileError(path, problem)
    return shapes


def _check_tensors(model_dir: Path, files: dict[Path, list[str]], headers: dict[Path, dict[str, tuple[int, ...]]],
                   config: ModelConfig) -> None:
    """Every tensor to load is in its file, has a name and shape of the model, and none is missing."""
    check = CheckpointTensors(hf_weight_shapes(config), config)
    for path, names in files.items():
        for name in names or sorted(headers[path]):
            if name not in headers[path]:
                raise ModelFileError(path, f"has no tensor {name!r}, which {INDEX_FILE} maps to it")
            try:
                check.take(name, headers[path][name])
            except ValueError as exc:
                raise ModelFileError(path, str(exc)) from None
    try:
        check.finish()
    except ValueError as exc:
        raise ModelFileError(next(iter(files)) if len(files) == 1 else model_dir, str(exc)) from None


def load_safetensors(
    model_dir: Union[str, Path], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Read and check the config and every file's header now (module docstring); yield
    ``(hf_name, tensor.to(dtype))`` lazily, each checked finite (`finite_cast`). Every problem,
    also one met while iterating (a file gone, a tensor with NaN), is a `ModelFileError`."""
    model_dir = Path(model_dir)
    config = read_hf_config(model_dir)
    files = safetensors_files(model_dir)
    headers = {path: safetensors_header(path) for path in files}
    _check_tensors(model_dir, files, headers, config)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path, names in files.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in names or sorted(headers[path]):
                        yield name, finite_cast(f.get_tensor(name), dtype, name, path)
            except (OSError, SafetensorError) as exc:
                raise ModelFileError(path, f"cannot read the file: {exc}") from None

    return config, tensors()
