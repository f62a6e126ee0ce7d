"""A saved pytree loaded onto any sharding: each process reads only the bytes its devices need.

``load_pytree(store, target)`` takes the shardings, shapes and dtypes from ``target`` (a tree
of ``jax.Array``, ``jax.ShapeDtypeStruct`` with shardings, NumPy arrays, scalars or strings,
matched to the stored leaves by path), not from the save: a tree saved over 8 devices loads
onto 4, onto a mesh of another shape, or onto one process of several. Each stored chunk that
a device's box overlaps is read once, with ranged reads, each block checked against the
CRC32C the manifest recorded for it, and scattered into every box that needs it; the chunks
are read in parallel. Nothing read is believed unchecked: the tree, each index, and each
part's safetensors header must agree on every chunk's place before its bytes are used.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ckptstore.checkpoint import Checkpoint
from ckptstore.coordinated import agreed_checkpoint
from ckptstore.errors import InvalidInputError, ManifestCorruptError, ShardNotFoundError
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
    tensor_name,
)
from ckptstore.jax.leaves import decode_value, flatten, numpy_dtype, scalar_kind
from ckptstore.jax.multiprocess import JaxCollective
from ckptstore.jax.reads import BlockReader, ReadStats
from ckptstore.safetensors_layout import header_length, parse_header

__all__ = ["load_pytree", "stored_tree"]

READERS = 8
"""Chunks read at the same time."""
_WINDOW = 64 * 1024 * 1024
"""A chunk that boxes need only parts of the rows of is read in row windows of about this size."""
_LOADS = 0


@dataclass(frozen=True)
class _Stored:
    """A checkpoint's tree: every leaf's entry, and each array leaf's chunks."""

    checkpoint: Checkpoint
    leaves: Mapping[str, Mapping[str, Any]]
    chunks: Mapping[str, Sequence[StoredChunk]]
    where: str


def stored_tree(checkpoint: Checkpoint, reader: BlockReader | None = None) -> _Stored:
    """The tree a checkpoint holds, every document checked: the chunks of each array tile it,
    and each chunk is where its part's safetensors header says its tensor is."""
    where = f"{checkpoint.url} step {checkpoint.step}"
    reader = reader or BlockReader(checkpoint)
    sizes = {name: record.size for name, record in checkpoint.shards.items()}
    if TREE not in sizes:
        raise ShardNotFoundError(
            f"{where} has no {TREE}: it was not saved by ckptstore.jax (save_pytree)",
            url=checkpoint.url,
            step=checkpoint.step,
            key=TREE,
        )
    processes, entries = parse_tree(checkpoint.read(TREE), f"{where}: {TREE}")
    leaves = {str(entry["name"]): entry for entry in entries}
    arrays = {name: e for name, e in leaves.items() if e.get("kind") in ARRAY_KINDS}
    chunks: dict[str, list[StoredChunk]] = defaultdict(list)
    by_part: dict[str, list[StoredChunk]] = defaultdict(list)
    for process in range(processes):
        name = index_shard(process)
        if name not in sizes:
            raise ManifestCorruptError(f"{where}: process {process}'s index {name} is missing")
        for chunk in parse_index(checkpoint.read(name), f"{where}: {name}", process, arrays, sizes):
            chunks[chunk.leaf].append(chunk)
            by_part[chunk.shard].append(chunk)
    for name, entry in arrays.items():
        check_coverage(name, entry["shape"], chunks[name], where)
    for part, held in by_part.items():
        _check_part(reader, part, sizes[part], held, arrays, f"{where}: {part}")
    return _Stored(checkpoint, leaves, chunks, where)


def _check_part(
    reader: BlockReader,
    part: str,
    size: int,
    chunks: Sequence[StoredChunk],
    arrays: Mapping[str, Mapping[str, Any]],
    where: str,
) -> None:
    """Each chunk an index puts in ``part`` is a tensor of its header, at the same bytes, of
    its leaf's dtype and its box's shape: an index cannot point a chunk at other bytes."""
    length = header_length(bytes(reader.read(part, 0, min(8, size))), size, where)
    layout = parse_header(bytes(reader.read(part, 8, length)), size, where)
    for chunk in chunks:
        tensor = layout.tensors.get(tensor_name(chunk.leaf, chunk.box))
        shape = tuple(stop - start for start, stop in chunk.box)
        if (
            tensor is None
            or (tensor.begin, tensor.end) != (chunk.offset, chunk.offset + chunk.nbytes)
            or tensor.dtype != arrays[chunk.leaf]["dtype"]
            or tensor.shape != shape
        ):
            raise ManifestCorruptError(
                f"{where}: its header does not hold chunk {chunk.box} of leaf {chunk.leaf} "
                f"where the index says"
            )


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
    step. A NumPy leaf loads as NumPy, a scalar or string leaf as stored (of the same type).
    Shapes and dtypes must be the stored ones, but a Python scalar where an array was stored
    (a fresh TrainState's ``step``) takes the stored array, placed as a leaf without a
    sharding. Every target leaf must be stored; a stored leaf the target lacks is an error
    unless ``partial``.

    Without a target: nested dicts and lists of NumPy arrays (a typed PRNG key: its key
    data), scalars and strings, by the stored paths.
    """
    checkpoint = source if isinstance(source, Checkpoint) else _agreed(source, step, timeout_s)
    reader = BlockReader(checkpoint, stats)
    stored = stored_tree(checkpoint, reader)
    if target is None:
        return _untargeted(stored, reader)
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
        default = _default_sharding(leaf.value for leaf in leaves)
        load = _Load(stored, pool, reader, default)
        planned = [load.plan(leaf.name, leaf.value) for leaf in leaves]
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


def _is_key(target: Any) -> bool:
    dtype = getattr(target, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


_ARRAY_TARGETS = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)


@dataclass(frozen=True)
class _Load:
    """One load: what it reads from, with what, and where leaves without a sharding go."""

    stored: _Stored
    pool: ThreadPoolExecutor
    reader: BlockReader
    default: Any

    def plan(self, name: str, target: Any) -> Any:
        """Start reading what leaf ``name`` needs; returns what finishes it."""
        entry = self.stored.leaves[name]
        where = f"{self.stored.where}: leaf {name}"
        kind = entry.get("kind")
        if kind == "key" or _is_key(target):
            return self._key(name, entry, target, where)
        if kind not in ARRAY_KINDS:
            if isinstance(target, _ARRAY_TARGETS):
                raise InvalidInputError(f"{where} is a stored {kind}, not an array")
            if scalar_kind(target) != kind:
                raise InvalidInputError(
                    f"{where} is a stored {kind}; the target's is a {type(target).__name__}"
                )
            value = decode_value(entry, where)
            return lambda: value
        shape = tuple(entry["shape"])
        dtype = numpy_dtype(entry["dtype"], where)
        if scalar_kind(target) in ("bool", "int", "float", "complex"):
            # A scalar placeholder (a fresh TrainState's step is 0; the saved one, an array):
            # the array as it was saved, placed as a leaf without a sharding (NumPy if it was).
            stand_in: Any = np.empty(shape, dtype)
            if kind == "array":
                stand_in = jax.ShapeDtypeStruct(shape, dtype, sharding=self.default)  # type: ignore[no-untyped-call]
            elif entry.get("scalar"):
                stand_in = stand_in[()]
            return self.plan(name, stand_in)
        if not isinstance(target, _ARRAY_TARGETS):
            raise InvalidInputError(
                f"{where} is a stored array of shape {list(shape)}; the target's is a "
                f"{type(target).__name__} (give an array or a jax.ShapeDtypeStruct)"
            )
        if tuple(target.shape) != shape or _little(np.dtype(target.dtype)) != dtype:
            raise InvalidInputError(
                f"{where} is stored as {dtype.name}{list(shape)}; the target is "
                f"{np.dtype(target.dtype).name}{list(target.shape)}"
            )
        chunks = self.stored.chunks[name]
        whole = tuple((0, size) for size in shape)
        if isinstance(target, (np.ndarray, np.generic)):
            boxes = self.read(dtype, [whole], chunks)
            scalar = isinstance(target, np.generic)
            return lambda: boxes()[whole][()] if scalar else boxes()[whole]
        if jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise InvalidInputError(
                f"{where} is {dtype.name}, which JAX would truncate with 64-bit types off: "
                f"enable jax_enable_x64, or give a NumPy target"
            )
        sharding = _sharding_of(target, self.default)
        try:
            indices = sharding.addressable_devices_indices_map(shape)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{where}: the target's sharding does not fit: {exc}") from exc
        boxes = self.read(dtype, list({box_of(i, shape): None for i in indices.values()}), chunks)

        def finish() -> Any:
            host = boxes()
            return jax.make_array_from_callback(
                shape, sharding, lambda index: host[box_of(index, shape)]
            )

        return finish

    def _key(self, name: str, entry: Mapping[str, Any], target: Any, where: str) -> Any:
        """A typed PRNG key: its data read whole, wrapped, and put on the target's sharding."""
        if entry.get("kind") != "key" or not _is_key(target):
            raise InvalidInputError(
                f"{where}: a typed PRNG key loads only into a typed PRNG key (stored: a "
                f"{entry.get('kind')}; the target: {_describe_target(target)})"
            )
        impl = str(entry.get("impl"))
        whole = tuple((0, size) for size in entry["shape"])
        dtype = numpy_dtype(entry["dtype"], where)
        boxes = self.read(dtype, [whole], self.stored.chunks[name])

        def finish() -> Any:
            try:
                keys = jax.random.wrap_key_data(jax.numpy.asarray(boxes()[whole]), impl=impl)
            except (TypeError, ValueError) as exc:
                raise ManifestCorruptError(f"{where}: key data {impl!r} refuses: {exc}") from exc
            if str(keys.dtype) != str(target.dtype) or tuple(keys.shape) != tuple(target.shape):
                raise InvalidInputError(
                    f"{where} holds {keys.dtype} keys of shape {list(keys.shape)}; the target "
                    f"{target.dtype} of shape {list(target.shape)}"
                )
            sharding = _sharding_of(target, self.default)
            try:  # per addressable device: the sharding may span other processes' devices
                placed = sharding.addressable_devices_indices_map(keys.shape)
            except (TypeError, ValueError) as exc:
                raise InvalidInputError(
                    f"{where}: the target's sharding does not fit: {exc}"
                ) from exc
            pieces = [jax.device_put(keys[index], device) for device, index in placed.items()]
            return jax.make_array_from_single_device_arrays(keys.shape, sharding, pieces)

        return finish

    def read(self, dtype: np.dtype[Any], boxes: list[Box], chunks: Sequence[StoredChunk]) -> Any:
        """Start reading ``boxes`` of a leaf: each overlapping chunk read once, on the pool,
        and scattered into every box; returns what waits for them (boxes by box)."""
        outs = {box: np.empty(tuple(stop - start for start, stop in box), dtype) for box in boxes}
        if self.reader.stats is not None:
            self.reader.stats.add(needed=sum(out.nbytes for out in outs.values()))
        futures = [
            self.pool.submit(_copy_chunk, self.reader, chunk, dtype, outs)
            for chunk in chunks
            if any(_overlap(box, chunk.box) is not None for box in boxes)
        ]

        def wait() -> dict[Box, np.ndarray[Any, Any]]:
            for future in futures:
                future.result()
            return outs

        return wait


def _little(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` in little-endian order, as stored (a big-endian NumPy target is filled too)."""
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


def _describe_target(target: Any) -> str:
    return str(getattr(target, "dtype", type(target).__name__))


def _overlap(box: Box, other: Box) -> Box | None:
    """Where two boxes meet, or None."""
    overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, other, strict=True))
    return None if any(start >= stop for start, stop in overlap) else overlap


def _copy_chunk(
    reader: BlockReader,
    chunk: StoredChunk,
    dtype: np.dtype[Any],
    outs: Mapping[Box, np.ndarray[Any, Any]],
) -> None:
    """Copy what each box of ``outs`` needs of ``chunk`` into it; the chunk's rows that boxes
    need only in part are read once, in windows, and scattered to all of them."""
    shape = tuple(stop - start for start, stop in chunk.box)
    if not shape:  # a 0-d leaf: one element, one box
        for out in outs.values():
            reader.read(chunk.shard, chunk.offset, chunk.nbytes, _bytes_of(out))
        return
    row = math.prod(shape[1:]) * dtype.itemsize
    partial: list[tuple[Box, np.ndarray[Any, Any], Box]] = []
    for box, out in outs.items():
        overlap = _overlap(box, chunk.box)
        if overlap is None:
            continue
        source = [(a - c, b - c) for (a, b), (c, _) in zip(overlap, chunk.box, strict=True)]
        target = [(a - c, b - c) for (a, b), (c, _) in zip(overlap, box, strict=True)]
        whole_rows = all(source[d] == (0, shape[d]) for d in range(1, len(shape)))
        out_rows = all(target[d] == (0, out.shape[d]) for d in range(1, len(shape)))
        if whole_rows and out_rows:  # one run of bytes in the chunk and in ``out``: in place
            first, last = source[0]
            into = _bytes_of(out[target[0][0] : target[0][1]])
            reader.read(chunk.shard, chunk.offset + first * row, (last - first) * row, into)
        else:
            partial.append((overlap, out, box))
    if not partial:
        return
    first = min(overlap[0][0] for overlap, _, _ in partial) - chunk.box[0][0]
    last = max(overlap[0][1] for overlap, _, _ in partial) - chunk.box[0][0]
    per = max(1, _WINDOW // max(row, 1))
    for start in range(first, last, per):
        stop = min(last, start + per)
        data = reader.read(chunk.shard, chunk.offset + start * row, (stop - start) * row)
        rows = np.frombuffer(data, dtype=dtype).reshape((stop - start, *shape[1:]))
        base = chunk.box[0][0]
        window: Box = ((base + start, base + stop), *chunk.box[1:])
        for overlap, out, box in partial:
            here = _overlap(overlap, window)
            if here is None:
                continue
            taken = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(here, window, strict=True))
            placed = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(here, box, strict=True))
            out[placed] = rows[taken]


def _bytes_of(array: np.ndarray[Any, Any]) -> memoryview:
    """A C-contiguous array's memory as writable bytes."""
    flat: Any = array.reshape(-1).view(np.uint8)
    return memoryview(flat)


def _untargeted(stored: _Stored, reader: BlockReader) -> Any:
    """The stored tree as nested dicts and lists of NumPy arrays, scalars and strings."""
    values: dict[str, Any] = {}
    for name, entry in stored.leaves.items():
        where = f"{stored.where}: leaf {name}"
        if entry.get("kind") in ARRAY_KINDS:
            whole = tuple((0, size) for size in entry["shape"])
            dtype = numpy_dtype(entry["dtype"], where)
            with ThreadPoolExecutor(READERS, thread_name_prefix="ckptstore-jax-load") as pool:
                load = _Load(stored, pool, reader, None)
                out = load.read(dtype, [whole], stored.chunks[name])()
            value: Any = out[whole]
            values[name] = value[()] if entry.get("scalar") else value
        else:
            values[name] = decode_value(entry, where)
    if len(stored.leaves) == 1 and not next(iter(stored.leaves.values()))["keys"]:
        return next(iter(values.values()))  # the tree is one leaf
    root: dict[tuple[str, Any], Any] = {}
    for name, entry in stored.leaves.items():
        keys = [tuple(key) for key in entry["keys"]]
        node = root
        for depth, key in enumerate(keys):
            last = depth == len(keys) - 1
            held = node.get(key)
            if held is not None and (last or not isinstance(held, _Node)):
                raise ManifestCorruptError(f"{stored.where}: leaf {name} is inside another leaf")
            if last:
                node[key] = values[name]
            else:
                node = node.setdefault(key, _Node())
        if not keys:
            raise ManifestCorruptError(f"{stored.where}: leaf {name} has an empty path")
    return _containers(root, stored.where)


class _Node(dict[tuple[str, Any], Any]):
    """An inner node of an untargeted tree, while it is built."""


def _containers(node: Any, where: str) -> Any:
    """Nodes keyed by ("index"/"flat", i) become lists, by ("key"/"attr", k) dicts."""
    if not isinstance(node, dict):
        return node
    kinds = {kind for kind, _ in node}
    if kinds <= {"index", "flat"}:
        if sorted(i for _, i in node) != list(range(len(node))):
            raise ManifestCorruptError(f"{where}: a sequence's indices are not 0..{len(node) - 1}")
        return [_containers(node[key], where) for key in sorted(node, key=lambda key: key[1])]
    if not kinds <= {"key", "attr"} or len({key for _, key in node}) != len(node):
        raise ManifestCorruptError(f"{where}: a node of the tree mixes kinds of path entries")
    return {key: _containers(value, where) for (_, key), value in node.items()}
