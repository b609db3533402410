"""A GGUF file -> (`ModelConfig`, lazy iterator of (HF name, full tensor)).

Every tensor is dequantized with the ``gguf`` package's own ``gguf.quants.dequantize`` (all the
types it implements: F32, F16, BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants, the IQ types, ...),
one tensor at a time, then cast to the requested dtype. GGUF stores dimensions innermost first
(ggml ``ne`` order); ``GGUFReader`` exposes them reversed, which is already HF's [out, in] layout.

llama.cpp's converter permutes the rows of Q and K of ``llama``-architecture models to its
interleaved rope layout; `unpermute_qk` undoes it. ``qwen2`` files are stored unpermuted.
A split GGUF (``name-00001-of-0000N.gguf``) is read from all its shards, given the first.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, Keys
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from arfusion.engine.models.checkpoint_tensors import CheckpointTensors
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.registry import hf_weight_shapes
from arfusion.engine.weights.errors import ModelFileError, finite_cast
from arfusion.engine.weights.gguf_file import open_gguf
from arfusion.engine.weights.gguf_moe_names import MOE_NAME_ARCHITECTURES, hf_moe_tensors, is_moe_tensor
from arfusion.engine.weights.gguf_names import (
    PERMUTED_QK_ARCHITECTURES,
    ROPE_FREQS_NAME,
    config_from_gguf,
    field_value,
    gguf_architecture,
    hf_tensor_name,
)

_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_Q_WEIGHT = re.compile(r"^blk\.\d+\.attn_q\.(weight|bias)$")
_K_WEIGHT = re.compile(r"^blk\.\d+\.attn_k\.(weight|bias)$")


class UnsupportedTensorTypeError(ModelFileError):
    """A tensor whose GGML type the gguf package cannot dequantize; names the file, tensor and type."""


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of a Q or K weight (or bias), rows grouped by head.

    llama.cpp writes, per head of ``d`` rows, row ``h * d/2 + j`` (half h, pair j) of the HF
    tensor to row ``2j + h``; this is the inverse: ``reshape(n_head, d/2, 2, ...).swapaxes(1, 2)``.
    Returns a new contiguous tensor of the same shape.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows into {n_head} heads of an even size")
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_shard_paths(path: Path, reader: GGUFReader) -> list[Path]:
    """All files of the model: ``[path]``, or every shard of a split GGUF given its first shard."""
    count = int(field_value(reader, Keys.Split.LLM_KV_SPLIT_COUNT, 1))
    if count <= 1:
        return [path]
    m = _SHARD_NAME.match(path.name)
    if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
        raise ModelFileError(path, f"part of a {count}-file split GGUF: pass its first shard, <name>-00001-of-{count:05d}.gguf")
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for p in paths:
        if not p.is_file():
            raise ModelFileError(p, f"missing: shard of the {count}-file split GGUF {path}")
    return paths


@dataclass(frozen=True)
class ParsedGGUF:
    """A GGUF model's files, each checked and parsed once (`open_gguf`): the first shard (which
    holds the metadata, the tokenizer's too) and every shard's reader, in order. The launcher
    parses the file once and hands this to the tokenizer, the checks and the weights' load."""

    path: Path
    readers: tuple[tuple[Path, GGUFReader], ...]

    @property
    def metadata(self) -> GGUFReader:
        return self.readers[0][1]


def parse_gguf(path: Union[str, Path]) -> ParsedGGUF:
    """Check and parse the GGUF file ``path`` and, for a split GGUF given its first shard, the
    other shards. `ModelFileError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(path, "no such GGUF file")
    first = open_gguf(path)
    shard_paths = gguf_shard_paths(path, first)  # before reading metadata: only the first shard has it
    return ParsedGGUF(path, ((path, first), *((p, open_gguf(p)) for p in shard_paths[1:])))


@functools.lru_cache(maxsize=None)
def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` implements ``qtype`` (probed on one zero block)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _to_torch(tensor: ReaderTensor, dtype: torch.dtype, path: Path) -> torch.Tensor:
    """Dequantize one tensor of the file ``path`` to float32 (HF shape), then cast to ``dtype``,
    checked finite (`finite_cast`); copies out of the memmap."""
    array = dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:
        array = array.copy()
    return finite_cast(torch.from_numpy(array), dtype, tensor.name, path)


def _find(readers: list[tuple[Path, GGUFReader]], name: str) -> Optional[ReaderTensor]:
    return next((t for _, r in readers for t in r.tensors if t.name == name), None)


def _hf_shapes(tensor: ReaderTensor, architecture: str, moe_names: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The HF ``(name, shape)`` of each tensor the loader makes of a GGUF tensor (several for
    stacked experts, none for one that is not a weight), from its header only. ValueError for a
    name the mapping does not know."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if moe_names and is_moe_tensor(tensor.name):
        views = hf_moe_tensors(tensor.name, torch.empty(shape, device="meta"), architecture)
        return [(name, tuple(view.shape)) for name, view in views]
    name = hf_tensor_name(tensor.name)
    return [] if name is None else [(name, shape)]


def _config(readers: list[tuple[Path, GGUFReader]], path: Path) -> ModelConfig:
    """`config_from_gguf` of the first shard's metadata and every shard's tensor names;
    `ModelFileError` naming ``path`` for metadata that make no valid config."""
    rope_freqs = _find(readers, ROPE_FREQS_NAME)
    names = {t.name for _, r in readers for t in r.tensors}
    try:
        return config_from_gguf(
            readers[0][1], names, str(path),
            None if rope_freqs is None else dequantize(rope_freqs.data, rope_freqs.tensor_type),
        )
    except ModelFileError:
        raise
    except (ValueError, TypeError) as exc:  # a size out of range, a rope we cannot map, a string for a number
        raise ModelFileError(path, f"bad GGUF metadata: {exc}") from None


def _check_tensors(readers: list[tuple[Path, GGUFReader]], config: ModelConfig, moe_names: bool, path: Path) -> None:
    """Every tensor's type is dequantizable, its name known and its shape the model's; no
    weight of the model is missing. `ModelFileError` naming the file (and the GGUF tensor)."""
    check = CheckpointTensors(hf_weight_shapes(config), config)
    for shard, reader in readers:
        for t in reader.tensors:
            if not _dequantizable(t.tensor_type):
                raise UnsupportedTensorTypeError(
                    shard, f"tensor {t.name!r} has type {t.tensor_type.name}, which gguf.quants.dequantize does not support")
            try:
                pairs = _hf_shapes(t, config.architecture, moe_names)
            except ValueError as exc:
                raise ModelFileError(shard, str(exc)) from None
            for name, shape in pairs:
                try:
                    check.take(name, shape)
                except ValueError as exc:
                    raise ModelFileError(shard, f"{exc} (GGUF tensor {t.name!r})") from None
    try:
        check.finish()
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from None


def load_gguf(file: Union[str, Path, ParsedGGUF],
              dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Check the file now (`parse_gguf`, unless ``file`` is parsed already: a complete GGUF file;
    its config; every tensor's name, type and shape, none missing) and yield the tensors lazily,
    each checked finite.

    Raises `ModelFileError` naming the file and the problem (`MissingMetadataError` names the
    key, `UnsupportedTensorTypeError` the tensor and its type); while iterating, for a tensor
    with NaN or infinite values.
    """
    parsed = file if isinstance(file, ParsedGGUF) else parse_gguf(file)
    path, readers = parsed.path, list(parsed.readers)
    arch = gguf_architecture(parsed.metadata, str(path))
    config = _config(readers, path)
    moe_names = config.architecture in MOE_NAME_ARCHITECTURES  # experts, router or q/k norms are this file's
    _check_tensors(readers, config, moe_names, path)
    permuted = arch in PERMUTED_QK_ARCHITECTURES

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for shard, reader in readers:
            for t in reader.tensors:
                if moe_names and is_moe_tensor(t.name):
                    yield from hf_moe_tensors(t.name, _to_torch(t, dtype, shard), config.architecture)
                    continue
                name = hf_tensor_name(t.name)
                if name is None:
                    continue
                tensor = _to_torch(t, dtype, shard)
                if permuted and _Q_WEIGHT.match(t.name):
                    tensor = unpermute_qk(tensor, config.num_attention_heads)
                elif permuted and _K_WEIGHT.match(t.name):
                    tensor = unpermute_qk(tensor, config.num_key_value_heads)
                yield name, tensor

    return config, tensors()
