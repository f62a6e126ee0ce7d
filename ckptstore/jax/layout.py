"""Where a saved pytree's bytes are: the tree document, each process's index, and the
safetensors parts, all checked before a byte of an array is believed.

A checkpoint of a pytree holds ``pytree.json`` (every leaf: name, path, kind, shape, dtype,
and the value of a scalar or string leaf), one ``pytree-index.p<process>.json`` per process
(each array chunk that process wrote: its leaf, its box in the leaf's global shape, its shard,
and its byte range there) and that process's ``pytree.p<process>.<part>.safetensors`` files,
which any safetensors reader opens (a chunk's tensor is named ``<leaf>@<box>``). Every chunk
is written once, by the process that holds its first replica.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import ManifestCorruptError
from ckptstore.jsonload import JSONDocumentError, load_json
from ckptstore.safetensors_layout import ITEM_SIZES, encode

__all__ = [
    "ARRAY_KINDS",
    "FORMAT",
    "PART_SIZE",
    "TREE",
    "Box",
    "Chunk",
    "StoredChunk",
    "box_of",
    "check_coverage",
    "index_shard",
    "pack",
    "parse_index",
    "parse_tree",
    "part_shard",
    "tensor_name",
    "volume",
]

FORMAT = "ckptstore.jax/1"
TREE = "pytree.json"
PART_SIZE = 64 * 1024 * 1024
"""A process's chunks start a new safetensors part once the current one holds this many bytes:
the storage writes back one part while the next is written (a chunk is never split)."""

ARRAY_KINDS = ("array", "numpy", "key")
"""Leaves stored as chunks of arrays: a jax.Array, a NumPy array, a typed PRNG key's data."""

Box = tuple[tuple[int, int], ...]
"""A box of an array: ``(start, stop)`` per dimension."""


def index_shard(process: int) -> str:
    """The shard listing the chunks ``process`` wrote."""
    return f"pytree-index.p{process:05d}.json"


def part_shard(process: int, part: int) -> str:
    """Part ``part`` of the arrays ``process`` wrote."""
    return f"pytree.p{process:05d}.{part:05d}.safetensors"


def box_of(index: Any, shape: Sequence[int]) -> Box:
    """The box an array's shard index (slices, as JAX gives them) selects in ``shape``."""
    box = []
    for item, size in zip(index, shape, strict=True):
        start, stop, step = item.indices(size)
        if step != 1:
            raise ValueError(f"a shard index with step {step} is not a box")
        box.append((start, max(start, stop)))
    return tuple(box)


def volume(box: Box) -> int:
    """How many elements a box holds."""
    return math.prod(stop - start for start, stop in box)


@dataclass(frozen=True)
class Chunk:
    """A chunk to write: a box of a leaf and its bytes (C order, on the host)."""

    leaf: str
    dtype: str
    box: Box
    data: np.ndarray[Any, Any]


@dataclass(frozen=True)
class StoredChunk:
    """A chunk as its process's index records it."""

    leaf: str
    box: Box
    shard: str
    offset: int
    nbytes: int


def pack(
    process: int, chunks: Sequence[Chunk], part_size: int = PART_SIZE
) -> tuple[dict[str, list[Any]], bytes]:
    """Each part's safetensors chunks by shard name, and this process's index document."""
    groups: list[list[Chunk]] = []
    size = part_size
    for chunk in chunks:
        if size >= part_size:
            groups.append([])
            size = 0
        groups[-1].append(chunk)
        size += chunk.data.nbytes
    parts: dict[str, list[Any]] = {}
    records: list[dict[str, Any]] = []
    for number, group in enumerate(groups):
        name = part_shard(process, number)
        tensors = [
            (tensor_name(c.leaf, c.box), c.dtype, c.data.shape, _bytes(c.data)) for c in group
        ]
        encoded = encode(tensors, {"format": FORMAT})
        offset = len(memoryview(encoded[0]))
        for chunk in group:
            records.append(
                {
                    "leaf": chunk.leaf,
                    "box": [list(pair) for pair in chunk.box],
                    "shard": name,
                    "offset": offset,
                    "nbytes": chunk.data.nbytes,
                }
            )
            offset += chunk.data.nbytes
        parts[name] = encoded
    document = {"format": FORMAT, "process": process, "chunks": records}
    return parts, json.dumps(document, separators=(",", ":")).encode("utf-8")


def tensor_name(leaf: str, box: Box) -> str:
    """The name of a chunk's tensor in its safetensors part: ``<leaf>@<start>:<stop>,...``."""
    return f"{leaf}@" + ",".join(f"{start}:{stop}" for start, stop in box)


def _bytes(data: np.ndarray[Any, Any]) -> memoryview:
    flat: Any = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return memoryview(flat)


def _load(data: bytes, where: str) -> Any:
    try:
        return load_json(data, max_bytes=1 << 30, max_depth=16)
    except JSONDocumentError as exc:
        raise ManifestCorruptError(f"{where}: not a JSON document: it {exc}") from exc


def parse_tree(data: bytes, where: str) -> tuple[int, list[Mapping[str, Any]]]:
    """The number of processes that saved, and every leaf's entry, checked for shape."""
    document = _load(data, where)
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ManifestCorruptError(f"{where}: not a {FORMAT} tree document")
    processes: Any = document.get("processes")
    leaves: Any = document.get("leaves")
    if not _is_int(processes) or not 1 <= processes <= 1 << 20:
        raise ManifestCorruptError(f"{where}: bad process count {processes!r}")
    if not isinstance(leaves, list) or not all(isinstance(leaf, dict) for leaf in leaves):
        raise ManifestCorruptError(f"{where}: bad leaves")
    names: set[str] = set()
    for leaf in leaves:
        name = leaf.get("name")
        if not isinstance(name, str) or name in names:
            raise ManifestCorruptError(f"{where}: a leaf has a bad or repeated name: {name!r}")
        names.add(name)
        keys = leaf.get("keys")
        if not isinstance(keys, list) or not all(_is_key(key) for key in keys):
            raise ManifestCorruptError(f"{where}: leaf {name} has a bad path {keys!r}")
        if leaf.get("kind") in ARRAY_KINDS:
            shape, dtype = leaf.get("shape"), leaf.get("dtype")
            if (
                not isinstance(shape, list)
                or len(shape) > 64
                or not all(_is_int(d) and d >= 0 for d in shape)
                or dtype not in ITEM_SIZES
            ):
                raise ManifestCorruptError(f"{where}: leaf {name} has a bad shape or dtype")
    return processes, leaves


def _is_int(value: object) -> bool:
    """An int that is not a bool (JSON's true is not a number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_key(key: object) -> bool:
    """A path entry as ``path_keys`` writes it."""
    if not isinstance(key, list) or len(key) != 2:
        return False
    kind, value = key
    if kind in ("index", "flat"):
        return _is_int(value) and value >= 0
    return kind in ("key", "attr") and (isinstance(value, str) or _is_int(value))


def parse_index(
    data: bytes,
    where: str,
    process: int,
    arrays: Mapping[str, Mapping[str, Any]],
    shard_sizes: Mapping[str, int],
) -> Iterator[StoredChunk]:
    """A process's chunks, each checked against its leaf (a box inside the leaf's shape, bytes
    that hold the box) and its shard (a byte range inside it)."""
    document = _load(data, where)
    if (
        not isinstance(document, dict)
        or document.get("format") != FORMAT
        or document.get("process") != process
        or not isinstance(document.get("chunks"), list)
    ):
        raise ManifestCorruptError(f"{where}: not process {process}'s {FORMAT} index")
    for record in document["chunks"]:
        try:
            leaf = arrays[record["leaf"]]
            shape = leaf["shape"]
            box = tuple((start, stop) for start, stop in record["box"])
            shard, offset, nbytes = record["shard"], record["offset"], record["nbytes"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestCorruptError(f"{where}: a bad chunk record {record!r}") from exc
        if (
            not all(_is_int(start) and _is_int(stop) for start, stop in box)
            or not _is_int(offset)
            or not _is_int(nbytes)
            or not isinstance(shard, str)
            or not shard.startswith(f"pytree.p{process:05d}.")  # its own parts only
            or not shard.endswith(".safetensors")
        ):
            raise ManifestCorruptError(f"{where}: a bad chunk record {record!r}")
        if len(box) != len(shape) or not all(
            0 <= start <= stop <= size for (start, stop), size in zip(box, shape, strict=True)
        ):
            raise ManifestCorruptError(f"{where}: chunk box {box} is outside {shape}")
        if nbytes != volume(box) * ITEM_SIZES[leaf["dtype"]]:
            raise ManifestCorruptError(f"{where}: chunk {box} of {record['leaf']}: {nbytes} bytes")
        if shard not in shard_sizes or not 0 <= offset <= shard_sizes[shard] - nbytes:
            raise ManifestCorruptError(f"{where}: chunk {box} is outside shard {shard!r}")
        yield StoredChunk(str(record["leaf"]), box, shard, offset, nbytes)


def check_coverage(
    name: str, shape: Sequence[int], chunks: Sequence[StoredChunk], where: str
) -> None:
    """The chunks of a leaf hold every element of its shape exactly once.

    A sharding cuts each dimension into intervals and makes one chunk of each combination (a
    grid): here each dimension's intervals must tile it, and the chunks must be exactly the
    distinct combinations, which takes a sort per dimension, not a comparison of every pair.
    """
    cells = {chunk.box for chunk in chunks}
    if len(cells) != len(chunks):
        raise ManifestCorruptError(f"{where}: a chunk of leaf {name} is recorded twice")
    expected = 1
    for dimension, size in enumerate(shape):
        intervals = sorted({box[dimension] for box in cells})
        position = 0
        for start, stop in intervals:
            if start != position or (stop <= start and size):
                raise ManifestCorruptError(
                    f"{where}: the chunks of leaf {name} do not tile dimension {dimension}"
                )
            position = stop
        if position != size:
            raise ManifestCorruptError(
                f"{where}: the chunks of leaf {name} do not cover dimension {dimension}"
            )
        expected *= len(intervals)
    if len(cells) != expected:
        raise ManifestCorruptError(
            f"{where}: the chunks of leaf {name} are {len(cells)}, not the {expected} a grid has"
        )
