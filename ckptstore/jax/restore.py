"""A saved pytree loaded onto any sharding: each process reads only the bytes its devices need.

``load_pytree(store, target)`` takes the shardings, shapes and dtypes from ``target`` (a tree
of ``jax.Array``, ``jax.ShapeDtypeStruct`` with shardings, NumPy arrays, scalars or strings,
matched to the stored leaves by path), not from the save: a tree saved over 8 devices loads
onto 4, onto a mesh of another shape, or onto one process of several. For each box a device
needs, the chunks that overlap it are read with ranged reads, each block checked against the
CRC32C the manifest recorded for it; the boxes are read in parallel.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ckptstore.checkpoint import Checkpoint
from ckptstore.coordinated import agreed_checkpoint
from ckptstore.errors import InvalidInputError, ManifestCorruptError
from ckptstore.interface import CheckpointStore
from ckptstore.jax.layout import (
    ARRAY_KINDS,
    TREE,
    Box,
    StoredChunk,
    box_of,
    check_coverage,
    index_shard,
    parse_index,
    parse_tree,
)
from ckptstore.jax.leaves import decode_value, flatten, numpy_dtype
from ckptstore.jax.multiprocess import JaxCollective
from ckptstore.jax.reads import BlockReader, ReadStats

__all__ = ["load_pytree", "stored_tree"]

READERS = 8
"""Boxes read at the same time."""
_WINDOW = 64 * 1024 * 1024
"""A box that is not one run of bytes of its chunk is read in row windows of about this size."""
_LOADS = 0


@dataclass(frozen=True)
class _Stored:
    """A checkpoint's tree: every leaf's entry, and each array leaf's chunks."""

    checkpoint: Checkpoint
    leaves: Mapping[str, Mapping[str, Any]]
    chunks: Mapping[str, Sequence[StoredChunk]]
    where: str


def stored_tree(checkpoint: Checkpoint) -> _Stored:
    """The tree a checkpoint holds, every document checked (the chunks cover each array)."""
    where = f"{checkpoint.url} step {checkpoint.step}"
    sizes = {name: record.size for name, record in checkpoint.shards.items()}
    if TREE not in sizes:
        raise ManifestCorruptError(f"{where}: no {TREE}: not a checkpoint of a pytree")
    processes, entries = parse_tree(checkpoint.read(TREE), f"{where}: {TREE}")
    leaves = {str(entry["name"]): entry for entry in entries}
    arrays = {name: e for name, e in leaves.items() if e.get("kind") in ARRAY_KINDS}
    chunks: dict[str, list[StoredChunk]] = defaultdict(list)
    for process in range(processes):
        name = index_shard(process)
        if name not in sizes:
            raise ManifestCorruptError(f"{where}: process {process}'s index {name} is missing")
        for chunk in parse_index(checkpoint.read(name), f"{where}: {name}", process, arrays, sizes):
            chunks[chunk.leaf].append(chunk)
    for name, entry in arrays.items():
        check_coverage(name, entry["shape"], chunks[name], where)
    return _Stored(checkpoint, leaves, chunks, where)


def load_pytree(
    source: CheckpointStore | Checkpoint,
    target: Any = None,
    *,
    step: int | None = None,
    partial: bool = False,
    stats: ReadStats | None = None,
    timeout_s: float = 600.0,
) -> Any:
    """Load a saved pytree; with ``target``, in its structure, onto its shardings.

    ``source``: a checkpoint, or a store (``step``, or the latest: in a multi-process job, the
    one the coordinator chose, for every process).

    ``target``: a ``jax.Array`` or ``jax.ShapeDtypeStruct`` leaf loads as an array with its
    sharding. One without a sharding (a struct without one, an array JAX placed by itself,
    uncommitted) loads replicated over the mesh of the target's first leaf that has a
    NamedSharding (else onto the first local device), so that it meets the others in a jitted
    step. A NumPy leaf loads as NumPy, a scalar or string leaf as stored. Shapes and dtypes
    must be the stored ones, but a Python scalar where an array was stored (a fresh
    TrainState's ``step``) takes the stored array, placed as a leaf without a sharding. Every
    target leaf must be stored; a stored leaf the target lacks is an error unless ``partial``.

    Without a target: nested dicts and lists of NumPy arrays (a typed PRNG key: its key
    data), scalars and strings, by the stored paths.
    """
    checkpoint = source if isinstance(source, Checkpoint) else _agreed(source, step, timeout_s)
    stored = stored_tree(checkpoint)
    if target is None:
        return _untargeted(stored, BlockReader(checkpoint, stats))
    leaves, treedef = flatten(target)
    names = {leaf.name for leaf in leaves}
    missing = [leaf.name for leaf in leaves if leaf.name not in stored.leaves]
    if missing:
        raise InvalidInputError(
            f"{stored.where}: the target has leaves the checkpoint does not: {', '.join(missing)}"
        )
    extra = [name for name in stored.leaves if name not in names]
    if extra and not partial:
        raise InvalidInputError(
            f"{stored.where}: the checkpoint has leaves the target does not: {', '.join(extra)} "
            f"(partial=True loads the target's only)"
        )
    with ThreadPoolExecutor(READERS, thread_name_prefix="ckptstore-jax-load") as pool:
        reader = BlockReader(checkpoint, stats)
        default = _default_sharding(leaf.value for leaf in leaves)
        planned = [_plan(stored, leaf.name, leaf.value, pool, reader, default) for leaf in leaves]
        values = [plan() for plan in planned]
    return jax.tree_util.tree_unflatten(treedef, values)


def _agreed(store: CheckpointStore, step: int | None, timeout_s: float) -> Checkpoint:
    global _LOADS
    if step is not None or jax.process_count() == 1:
        return agreed_checkpoint(store, _Single(), step)
    _LOADS += 1
    return agreed_checkpoint(store, JaxCollective(f"ckptstore/load/{_LOADS}", timeout_s=timeout_s))


class _Single:
    rank, size = 0, 1

    def broadcast(self, value: Any) -> Any:
        return value

    def gather(self, value: Any) -> list[Any] | None:
        return [value]


def _default_sharding(targets: Iterable[Any]) -> Any:
    """Where a leaf goes whose target names no sharding (a scalar placeholder, a
    ShapeDtypeStruct without one): replicated over the mesh of the target's first leaf that
    has a NamedSharding, so that it meets the others in a jitted step; else the first local
    device."""
    for target in targets:
        sharding = getattr(target, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            replicated: Any = jax.sharding.PartitionSpec()  # type: ignore[no-untyped-call]
            return jax.sharding.NamedSharding(sharding.mesh, replicated)
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _sharding_of(target: Any, default: Any) -> Any:
    """The sharding a target leaf asks for: its own, unless it has none or JAX placed it by
    itself (an uncommitted array, which a jitted step moves where it is needed)."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or getattr(target, "committed", True) is False:
        return default
    return sharding


def _plan(
    stored: _Stored,
    name: str,
    target: Any,
    pool: ThreadPoolExecutor,
    reader: BlockReader,
    default: Any,
) -> Any:
    """Start reading what leaf ``name`` needs; returns what finishes it."""
    entry = stored.leaves[name]
    where = f"{stored.where}: leaf {name}"
    if entry.get("kind") == "key" or _is_key(target):
        return _plan_key(stored, name, entry, target, pool, reader, default)
    if entry.get("kind") not in ARRAY_KINDS:
        if isinstance(target, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
            raise InvalidInputError(f"{where} is a stored {entry.get('kind')}, not an array")
        value = decode_value(entry, where)
        return lambda: value
    shape = tuple(entry["shape"])
    dtype = numpy_dtype(entry["dtype"], where)
    if isinstance(target, (bool, int, float, complex)) and not isinstance(target, np.generic):
        # A scalar placeholder (a fresh TrainState's step is 0; the saved one, an array): the
        # array as it was saved, placed as a leaf without a sharding (NumPy if it was).
        stand_in: Any = np.empty(shape, dtype)
        if entry.get("kind") == "array":
            stand_in = jax.ShapeDtypeStruct(shape, dtype, sharding=default)  # type: ignore[no-untyped-call]
        elif entry.get("scalar"):
            stand_in = stand_in[()]
        return _plan(stored, name, stand_in, pool, reader, default)
    if not isinstance(target, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        raise InvalidInputError(
            f"{where} is a stored array of shape {list(shape)}; the target's is a "
            f"{type(target).__name__} (give an array or a jax.ShapeDtypeStruct)"
        )
    if tuple(target.shape) != shape or np.dtype(target.dtype) != dtype:
        raise InvalidInputError(
            f"{where} is stored as {dtype.name}{list(shape)}; the target is "
            f"{np.dtype(target.dtype).name}{list(target.shape)}"
        )
    chunks = stored.chunks[name]
    if isinstance(target, (np.ndarray, np.generic)):
        whole = tuple((0, size) for size in shape)
        future = pool.submit(_read_box, reader, dtype, whole, chunks)
        scalar = isinstance(target, np.generic)
        return lambda: future.result()[()] if scalar else future.result()
    sharding = _sharding_of(target, default)
    boxes: dict[Box, Future[np.ndarray[Any, Any]]] = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        box = box_of(index, shape)
        if box not in boxes:
            boxes[box] = pool.submit(_read_box, reader, dtype, box, chunks)

    def finish() -> Any:
        host = {box: future.result() for box, future in boxes.items()}
        return jax.make_array_from_callback(
            shape, sharding, lambda index: host[box_of(index, shape)]
        )

    return finish


def _is_key(target: Any) -> bool:
    dtype = getattr(target, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def _plan_key(
    stored: _Stored,
    name: str,
    entry: Mapping[str, Any],
    target: Any,
    pool: ThreadPoolExecutor,
    reader: BlockReader,
    default: Any,
) -> Any:
    """A typed PRNG key: its data read whole, wrapped, and put on the target's sharding."""
    where = f"{stored.where}: leaf {name}"
    if entry.get("kind") != "key" or not _is_key(target):
        raise InvalidInputError(
            f"{where}: a typed PRNG key loads only into a typed PRNG key (stored: a "
            f"{entry.get('kind')}; the target: {getattr(target, 'dtype', type(target).__name__)})"
        )
    impl = str(entry.get("impl"))
    if isinstance(target, jax.Array) and str(jax.random.key_impl(target)) != impl:
        raise InvalidInputError(f"{where} is a {impl} key; the target's is another kind")
    whole = tuple((0, size) for size in entry["shape"])
    dtype = numpy_dtype(entry["dtype"], where)
    future = pool.submit(_read_box, reader, dtype, whole, stored.chunks[name])

    def finish() -> Any:
        try:
            keys = jax.random.wrap_key_data(jax.numpy.asarray(future.result()), impl=impl)
        except (TypeError, ValueError) as exc:
            raise ManifestCorruptError(f"{where}: key data that {impl} refuses: {exc}") from exc
        if tuple(keys.shape) != tuple(target.shape):
            raise InvalidInputError(
                f"{where} holds keys of shape {list(keys.shape)}; the target's is "
                f"{list(target.shape)}"
            )
        return jax.device_put(keys, _sharding_of(target, default))

    return finish


def _untargeted(stored: _Stored, reader: BlockReader) -> Any:
    """The stored tree as nested dicts and lists of NumPy arrays, scalars and strings."""
    root: dict[Any, Any] = {}
    for name, entry in stored.leaves.items():
        where = f"{stored.where}: leaf {name}"
        if entry.get("kind") in ARRAY_KINDS:
            shape = tuple(entry["shape"])
            whole = tuple((0, size) for size in shape)
            dtype = numpy_dtype(entry["dtype"], where)
            value: Any = _read_box(reader, dtype, whole, stored.chunks[name])
            if entry.get("scalar"):
                value = value[()]
        else:
            value = decode_value(entry, where)
        keys = entry["keys"]
        if not keys:
            return value  # the tree is one leaf
        node = root
        for key in keys[:-1]:
            node = node.setdefault(_plain(key, where), {})
        node[_plain(keys[-1], where)] = value
    return _lists(root)


def _plain(key: Any, where: str) -> Any:
    if not isinstance(key, list) or len(key) != 2 or not isinstance(key[1], (str, int)):
        raise ManifestCorruptError(f"{where}: a bad path entry {key!r}")
    return tuple(key)


def _lists(node: Any) -> Any:
    """Nodes keyed by ("index"/"flat", i) become lists, by ("key"/"attr", k) dicts."""
    if not isinstance(node, dict):
        return node
    kinds = {kind for kind, _ in node}
    if kinds <= {"index", "flat"} and sorted(i for _, i in node) == list(range(len(node))):
        return [_lists(node[key]) for key in sorted(node, key=lambda key: key[1])]
    return {key: _lists(value) for (_, key), value in node.items()}


def _read_box(
    reader: BlockReader, dtype: np.dtype[Any], box: Box, chunks: Sequence[StoredChunk]
) -> np.ndarray[Any, Any]:
    """The elements of ``box`` of a leaf, from the chunks that overlap it."""
    out = np.empty(tuple(stop - start for start, stop in box), dtype=dtype)
    for chunk in chunks:
        overlap = tuple(
            (max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, chunk.box, strict=True)
        )
        if any(start >= stop for start, stop in overlap):
            continue
        _copy_overlap(reader, chunk, overlap, out, box, dtype)
    if reader.stats is not None:
        reader.stats.add(needed=out.nbytes)
    return out


def _copy_overlap(
    reader: BlockReader,
    chunk: StoredChunk,
    overlap: Box,
    out: np.ndarray[Any, Any],
    box: Box,
    dtype: np.dtype[Any],
) -> None:
    """Copy ``overlap`` (inside both ``box`` and the chunk) from storage into ``out``."""
    shape = tuple(stop - start for start, stop in chunk.box)
    source = [(a - c, b - c) for (a, b), (c, _) in zip(overlap, chunk.box, strict=True)]
    target = [(a - c, b - c) for (a, b), (c, _) in zip(overlap, box, strict=True)]
    if not shape:  # a 0-d leaf: one element
        reader.read(chunk.shard, chunk.offset, chunk.nbytes, _bytes_of(out))
        return
    row = math.prod(shape[1:]) * dtype.itemsize
    first, last = source[0]
    whole_rows = all(source[d] == (0, shape[d]) for d in range(1, len(shape)))
    out_rows = all(target[d] == (0, out.shape[d]) for d in range(1, len(shape)))
    if whole_rows and out_rows:  # one run of bytes in the chunk and in ``out``: read in place
        into = _bytes_of(out[target[0][0] : target[0][1]])
        reader.read(chunk.shard, chunk.offset + first * row, (last - first) * row, into)
        return
    per = max(1, _WINDOW // max(row, 1))
    inner = tuple(slice(a, b) for a, b in source[1:])
    placed = tuple(slice(a, b) for a, b in target[1:])
    for start in range(first, last, per):
        stop = min(last, start + per)
        data = reader.read(chunk.shard, chunk.offset + start * row, (stop - start) * row)
        rows = np.frombuffer(data, dtype=dtype).reshape((stop - start, *shape[1:]))
        at = target[0][0] + start - first
        destination, source_rows = (slice(at, at + stop - start), *placed), (slice(None), *inner)
        out[destination] = rows[source_rows]


def _bytes_of(array: np.ndarray[Any, Any]) -> memoryview:
    """A C-contiguous array's memory as writable bytes."""
    flat: Any = array.reshape(-1).view(np.uint8)
    return memoryview(flat)
