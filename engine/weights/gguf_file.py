"""`open_gguf`: a `gguf.GGUFReader` over a file checked first to be a complete GGUF file.

``GGUFReader`` trusts the sizes a file states: a file cut short fails inside numpy (an
IndexError, or "cannot reshape array of size ... into shape ..."), without the file's name or
the word truncated. `check_gguf_layout` walks the layout of the GGUF format, reading lengths,
types and offsets only:

    magic "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:     key (u64 length + bytes) | value type u32 | value (scalar, string, array)
    tensor infos: name | n_dims u32 | dims u64[n_dims] | GGML type u32 | data offset u64
    data:         from the next multiple of ``general.alignment`` (default 32); tensor i's
                  bytes are [start + offset_i, start + offset_i + n_elements * type_size / block)

and raises `ModelFileError` for the first problem: not a GGUF file (magic), a version the
reader does not read, metadata or tensor infos that run past the end of the file, an unknown
value or tensor type, or tensor data past the end ("truncated: N bytes, ...").
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Union

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, Keys
from gguf.constants import GGUF_DEFAULT_ALIGNMENT
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from arfusion.engine.weights.errors import ModelFileError, truncation

MAGIC = b"GGUF"
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_SCALAR_BYTES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


class _PastEnd(Exception):
    """A read that would end past the file's last byte."""


class _Cursor:
    """Reads unsigned integers and strings of one byte order from ``buf``, front to back."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.order, self.pos = buf, order, 0

    def skip(self, n: int) -> int:
        """Advance by ``n`` bytes; returns where they start. `_PastEnd` if they are not all there."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise _PastEnd
        return start

    def uint(self, n: int) -> int:
        start = self.skip(n)
        return int.from_bytes(self.buf[start:start + n], self.order)  # type: ignore[arg-type]

    def string(self) -> bytes:
        length = self.uint(8)
        start = self.skip(length)
        return self.buf[start:start + length]

    def value(self, value_type: int) -> None:
        """Skip one metadata value of ``value_type`` (arrays: every element). ValueError for an unknown type."""
        if value_type in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[GGUFValueType(value_type)])
        elif value_type == GGUFValueType.STRING:
            self.string()
        elif value_type == GGUFValueType.ARRAY:
            item_type, count = self.uint(4), self.uint(8)
            if item_type in _SCALAR_BYTES:
                self.skip(count * _SCALAR_BYTES[GGUFValueType(item_type)])
            else:
                for _ in range(count):  # each item takes at least 8 bytes: a bogus count soon runs past the end
                    self.value(item_type)
        else:
            raise ValueError(f"unknown metadata value type {value_type}")


def check_gguf_layout(path: Union[str, Path]) -> None:
    """Raise `ModelFileError` naming ``path`` unless it is a complete GGUF file (module docstring)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_BYTES:
                head = f.read(4)
                what = "not a GGUF file" if head and not MAGIC.startswith(head) else "truncated"
                raise ModelFileError(path, f"{what}: {size} bytes, shorter than the {HEADER_BYTES}-byte GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _check_layout(buf, path)
    except OSError as exc:
        raise ModelFileError(path, f"cannot read the file: {exc.strerror or exc}") from None


def _check_layout(buf: mmap.mmap, path: Union[str, Path]) -> None:
    size = len(buf)
    if buf[:4] != MAGIC:
        raise ModelFileError(path, f"not a GGUF file: it starts with {buf[:4]!r}, a GGUF file with {MAGIC!r}")
    order = "little" if int.from_bytes(buf[4:6], "little") else "big"  # as GGUFReader: the version's low half is not 0
    cur = _Cursor(buf, order)
    cur.skip(4)
    version = cur.uint(4)
    if version not in READER_SUPPORTED_VERSIONS:
        raise ModelFileError(path, f"GGUF version {version} is not supported (supported: {READER_SUPPORTED_VERSIONS})")
    tensor_count, kv_count = cur.uint(8), cur.uint(8)
    alignment = GGUF_DEFAULT_ALIGNMENT
    where = "the header"
    try:
        for i in range(kv_count):
            where = f"metadata entry {i + 1} of {kv_count}"
            key = cur.string().decode(errors="replace")
            where += f" ({key!r})"
            value_type = cur.uint(4)
            start = cur.pos
            cur.value(value_type)
            if key == Keys.General.ALIGNMENT and value_type == GGUFValueType.UINT32:
                alignment = int.from_bytes(buf[start:start + 4], order)  # type: ignore[arg-type]
        infos = []
        for i in range(tensor_count):
            where = f"tensor info {i + 1} of {tensor_count}"
            name = cur.string().decode(errors="replace")
            dims = [cur.uint(8) for _ in range(cur.uint(4))]
            infos.append((name, dims, cur.uint(4), cur.uint(8)))
    except _PastEnd:
        raise ModelFileError(path, f"truncated: the file ends ({size} bytes) inside {where}") from None
    except ValueError as exc:
        raise ModelFileError(path, f"corrupt GGUF {where}: {exc}") from None
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(path, f"corrupt GGUF metadata: general.alignment {alignment} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    _check_tensor_data(infos, data_start, size, path)


def _check_tensor_data(infos: list[tuple[str, list[int], int, int]], data_start: int, size: int,
                       path: Union[str, Path]) -> None:
    """Every tensor's type is known and its data lies inside the file."""
    ends = []
    for name, dims, type_id, offset in infos:
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise ModelFileError(path, f"tensor {name!r} has unknown GGML type {type_id}") from None
        elements = 1
        for d in dims:
            elements *= d
        ends.append((data_start + offset + elements * type_bytes // block, name))
    problem = truncation(size, ends)
    if problem:
        raise ModelFileError(path, problem)


def open_gguf(path: Union[str, Path]) -> GGUFReader:
    """`check_gguf_layout`, then ``GGUFReader(path)``; whatever the reader still refuses (a
    duplicate key or tensor name, ...) becomes a `ModelFileError` naming the file."""
    check_gguf_layout(path)
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader's own checks raise ValueError, KeyError, IndexError, ...
        raise ModelFileError(path, f"corrupt GGUF file: {type(exc).__name__}: {exc}") from None
