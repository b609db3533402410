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
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, Keys, MODEL_TENSOR, TENSOR_NAMES
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from engine.models.config import ModelConfig
from engine.weights.gguf_moe_names import MOE_NAME_ARCHITECTURES, hf_moe_tensors, is_moe_tensor
from engine.weights.gguf_names import (
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


class UnsupportedTensorTypeError(ValueError):
    """A tensor whose GGML type the gguf package cannot dequantize; names the tensor and type."""


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
        raise ValueError(f"{path} is part of a {count}-file split GGUF: pass its first shard, <name>-00001-of-{count:05d}.gguf")
    paths = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"GGUF shard {p} is missing (split of {count} files)")
    return paths


@functools.lru_cache(maxsize=None)
def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` implements ``qtype`` (probed on one zero block)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _to_torch(tensor: ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize one tensor to float32 (HF shape), then cast to ``dtype``; copies out of the memmap."""
    array = dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(dtype)


def _find(readers: list[GGUFReader], name: str) -> Optional[ReaderTensor]:
    return next((t for r in readers for t in r.tensors if t.name == name), None)


def load_gguf(path: Union[str, Path], dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Read the config now and check every tensor's name and type; yield the tensors lazily.

    Raises: FileNotFoundError (file or a shard missing), ValueError (unknown architecture or tensor
    name, vocab/embedding mismatch), `UnsupportedTensorTypeError` (names tensor and type),
    `MissingMetadataError` (names the key).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    first = GGUFReader(path)
    shard_paths = gguf_shard_paths(path, first)  # before reading metadata: only the first shard has it
    arch = gguf_architecture(first, str(path))
    readers = [first] + [GGUFReader(p) for p in shard_paths[1:]]
    rope_freqs = _find(readers, ROPE_FREQS_NAME)
    names = {t.name for r in readers for t in r.tensors}
    config = config_from_gguf(
        first, names, str(path), None if rope_freqs is None else dequantize(rope_freqs.data, rope_freqs.tensor_type)
    )
    moe_names = config.architecture in MOE_NAME_ARCHITECTURES  # experts, router or q/k norms are this file's
    for reader in readers:
        for t in reader.tensors:
            if not (moe_names and is_moe_tensor(t.name)):
                hf_tensor_name(t.name)  # raises for unknown names before any tensor is loaded
            if not _dequantizable(t.tensor_type):
                raise UnsupportedTensorTypeError(
                    f"tensor {t.name!r} in {path} has type {t.tensor_type.name}, which gguf.quants.dequantize does not support"
                )
    embedding = _find(readers, TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight")
    if embedding is None:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    if int(embedding.shape[1]) != config.vocab_size:
        raise ValueError(f"{path}: token_embd has {int(embedding.shape[1])} rows but the vocab has {config.vocab_size} tokens")
    permuted = arch in PERMUTED_QK_ARCHITECTURES

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for reader in readers:
            for t in reader.tensors:
                if moe_names and is_moe_tensor(t.name):
                    yield from hf_moe_tensors(t.name, _to_torch(t, dtype), config.architecture)
                    continue
                name = hf_tensor_name(t.name)
                if name is None:
                    continue
                tensor = _to_torch(t, dtype)
                if permuted and _Q_WEIGHT.match(t.name):
                    tensor = unpermute_qk(tensor, config.num_attention_heads)
                elif permuted and _K_WEIGHT.match(t.name):
                    tensor = unpermute_qk(tensor, config.num_key_value_heads)
                yield name, tensor

    return config, tensors()
