"""The safetensors file format, without a tensor library: what any reader of it can load.

A file is an 8-byte little-endian header length, a JSON header (each tensor's dtype code,
shape and ``data_offsets`` relative to the end of the header; ``__metadata__`` strings), then
every tensor's bytes, C order, in header order. ``encode`` streams a file from buffers as a
list of chunks (nothing is joined); ``parse_header`` checks a header before anything it says
is believed: known dtypes, offsets that hold the shapes exactly, data that covers the file
with no gap or overlap, so that a damaged header cannot ask for more memory than the file
holds nor point outside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptstore.driver import Buffer
from ckptstore.errors import InvalidInputError, ShardCorruptError
from ckptstore.jsonload import JSONDocumentError, load_json

__all__ = [
    "ITEM_SIZES",
    "MAX_HEADER",
    "TensorEntry",
    "TensorLayout",
    "encode",
    "header_length",
    "parse_header",
]

ITEM_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
"""Bytes per element of each safetensors dtype code this package writes and reads."""

MAX_HEADER = 100 * 1024 * 1024
"""The longest header read (safetensors' own limit): a damaged length asks for no more."""

_PAGE = 4096
_ALIGN_FROM = 1024 * 1024
"""Tensor data of at least this many bytes starts on a page boundary of the file: writing it
from page-aligned memory copies page onto page, and a memory map of the file aligns it."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its dtype code, shape, and where its bytes are in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Offset of its first byte from the start of the file (not of the data section)."""
    end: int

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return self.end - self.begin


@dataclass(frozen=True)
class TensorLayout:
    """A parsed header: each tensor, in file order, and the header's metadata strings."""

    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    data_start: int
    """Offset of the data section (8 + the header's length)."""


def encode(
    tensors: Sequence[tuple[str, str, Sequence[int], Buffer]],
    metadata: Mapping[str, str] | None = None,
) -> list[Buffer]:
    """A safetensors file as chunks: the header, then each tensor's bytes (``(name, dtype
    code, shape, C-order bytes)``, in that order); the header is padded with spaces so that
    the data starts at a multiple of 8 bytes (of a page when there is a megabyte or more)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    views: list[Buffer] = []
    offset = 0
    for name, dtype, shape, data in tensors:
        if dtype not in ITEM_SIZES:
            raise InvalidInputError(f"tensor {name!r}: dtype code {dtype!r} is not safetensors'")
        view = memoryview(data).cast("B")
        size = math.prod(shape) * ITEM_SIZES[dtype]
        if view.nbytes != size:
            raise InvalidInputError(
                f"tensor {name!r}: {view.nbytes} bytes do not hold {dtype} of shape {list(shape)}"
            )
        if name in header:
            raise InvalidInputError(f"tensor {name!r} twice in one file")
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        if size:
            views.append(view)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    align = _PAGE if offset >= _ALIGN_FROM else 8
    text += b" " * (-(8 + len(text)) % align)
    return [len(text).to_bytes(8, "little") + text, *views]


def header_length(prefix: bytes, size: int, where: str) -> int:
    """The header length a file of ``size`` bytes starts with (its first 8 bytes), checked."""
    if size < 8 or len(prefix) < 8:
        raise _corrupt(where, f"{size} bytes is too short")
    length = int.from_bytes(prefix[:8], "little")
    if not 2 <= length <= min(MAX_HEADER, size - 8):
        raise _corrupt(where, f"header length {length} does not fit a {size}-byte file")
    return length


def parse_header(header: bytes, size: int, where: str) -> TensorLayout:
    """The layout of a ``size``-byte file whose JSON header is ``header``, checked whole."""
    try:  # a header nests a tensor's shape in its entry in the header: 3 levels
        parsed = load_json(header, max_bytes=MAX_HEADER, max_depth=8)
    except JSONDocumentError as exc:
        raise _corrupt(where, f"header is not JSON: it {exc}") from exc
    if not isinstance(parsed, dict):
        raise _corrupt(where, "header is not a JSON object")
    start = 8 + len(header)
    metadata: dict[str, str] = {}
    entries: list[TensorEntry] = []
    for name, entry in parsed.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _corrupt(where, "__metadata__ is not an object of strings")
            metadata = dict(entry)
            continue
        try:
            dtype = str(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _corrupt(where, f"tensor {name!r} has a bad entry {entry!r}") from exc
        if dtype not in ITEM_SIZES:
            raise _corrupt(where, f"tensor {name!r} has an unknown dtype {dtype!r}")
        nbytes = math.prod(shape) * ITEM_SIZES[dtype]
        if min(shape, default=0) < 0 or begin < 0 or end - begin != nbytes:
            raise _corrupt(where, f"tensor {name!r}: offsets {begin}..{end} do not hold {shape}")
        entries.append(TensorEntry(name, dtype, shape, start + begin, start + end))
    entries.sort(key=lambda item: item.begin)
    position = start
    for entry in entries:
        if entry.begin != position:
            raise _corrupt(where, f"tensor {entry.name!r} starts at {entry.begin - start}, "
                           f"expected {position - start}")  # fmt: skip
        position = entry.end
    if position != size:
        raise _corrupt(where, f"tensors hold {position - start} bytes, the file {size - start}")
    return TensorLayout({entry.name: entry for entry in entries}, metadata, start)


def _corrupt(where: str, problem: str) -> ShardCorruptError:
    return ShardCorruptError(f"{where}: not a valid safetensors file: {problem}")
