"""A pytree saved as one checkpoint: published whole or not at all, from one process or many.

``save_pytree(store, step, tree)`` copies what this process must write to the host (each
addressable shard of a ``jax.Array`` whose replica is the first, NumPy leaves on process 0),
writes it as safetensors parts beside its index, and publishes. With several JAX processes
(``jax.distributed``), every process calls it with its part of the same tree and the commit
is ``ckptstore.coordinated``'s: nothing is published unless every process sealed its shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ckptstore.checkpoint import Checkpoint
from ckptstore.coordinated import save_coordinated
from ckptstore.errors import CheckpointStateError, CkptStoreError
from ckptstore.interface import CheckpointStore
from ckptstore.jax.layout import FORMAT, TREE, Box, Chunk, box_of, index_shard, pack
from ckptstore.jax.leaves import dtype_code, encode_value, flatten
from ckptstore.jax.multiprocess import JaxCollective
from ckptstore.pending import PendingCheckpoint

__all__ = [
    "PytreeSnapshot",
    "fail_together",
    "next_sequence",
    "save_pytree",
    "snapshot_pytree",
    "write_snapshot",
]

_SAVES = itertools.count()
"""Coordinated saves made by this process: every process counts the same saves in the same
order, so the count names one save's keys in the coordination service."""


@dataclass
class PytreeSnapshot:
    """What one process writes of a tree: the tree document (process 0 writes it), its own
    chunks on the host, and the metadata."""

    process: int
    processes: int
    tree: bytes
    chunks: list[Chunk]
    metadata: dict[str, Any] = field(default_factory=dict)
    structure: str = ""
    """A digest of the tree's leaves without their values (names, kinds, shapes, dtypes,
    shardings): alike on every process that saves the same tree."""

    @property
    def nbytes(self) -> int:
        """The bytes of this process's chunks."""
        return sum(chunk.data.nbytes for chunk in self.chunks)


def snapshot_pytree(
    tree: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    copy: bool = True,
    buffers: dict[tuple[str, Box], np.ndarray[Any, Any]] | None = None,
) -> PytreeSnapshot:
    """What this process writes of ``tree``, on the host; every leaf checked first.

    ``copy``: into memory ckptstore owns (what an asynchronous save needs: the trainer may
    donate or delete its arrays as soon as this returns); else NumPy views where JAX gives
    them (a CPU array's own memory), which the caller keeps alive until the write is done.
    Every device-to-host copy is started before the first is waited for. ``buffers``: host
    memory from an earlier snapshot of the same tree, by leaf and box, reused where the shape
    and dtype still match (no allocation, no page faults) and filled in with what is new.
    """
    leaves, _ = flatten(tree)
    process, processes = jax.process_index(), jax.process_count()
    entries: list[dict[str, Any]] = []
    device: list[tuple[str, str, Any, Any]] = []  # leaf, dtype, box, device array
    chunks: list[Chunk] = []
    for leaf in leaves:
        value = leaf.value
        entry: dict[str, Any] = {"name": leaf.name, "keys": leaf.keys}
        if isinstance(value, jax.Array) and jax.numpy.issubdtype(
            value.dtype, jax.dtypes.prng_key
        ):  # a typed PRNG key: its key data (uint32), and the name of its implementation
            entry["impl"] = str(jax.random.key_impl(value))
            value = jax.random.key_data(value)
            entry["kind"] = "key"
        if isinstance(value, jax.Array):
            code = dtype_code(value.dtype, leaf.name)
            entry.setdefault("kind", "array")
            entry.update(shape=list(value.shape), dtype=code)
            entry["sharding"] = _describe(value.sharding)
            # An array each process holds a whole copy of (on a device of its own: an
            # optimizer's step count, a key) has a first replica on every process: process 0's
            # is written, as a NumPy leaf is.
            own_copy = processes > 1 and value.is_fully_addressable
            for shard in value.addressable_shards:
                if shard.replica_id == 0 and (process == 0 or not own_copy):
                    device.append((leaf.name, code, box_of(shard.index, value.shape), shard.data))
        elif isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and _BIG_ENDIAN):
                array = array.astype(array.dtype.newbyteorder("<"))  # safetensors: little-endian
            code = dtype_code(array.dtype, leaf.name)
            entry.update(kind="numpy", shape=list(array.shape), dtype=code)
            entry["scalar"] = isinstance(value, np.generic)
            if process == 0:
                box = tuple((0, size) for size in array.shape)
                data = _copied(array, (leaf.name, box), buffers) if copy else _c_order(array)
                chunks.append(Chunk(leaf.name, code, box, data))
        else:
            described = encode_value(value, leaf.name)
            assert described is not None
            entry.update(described)
        entries.append(entry)
    for _, _, _, data in device:
        data.copy_to_host_async()  # all of them in flight before the first is waited for
    for name, code, box, data in device:
        host = np.asarray(data)
        if copy and _aliases_device_memory(data):  # a CPU device's own buffer: copy it
            host = _copied(host, (name, box), buffers)
        chunks.append(Chunk(name, code, box, _c_order(host)))
    document = {"format": FORMAT, "processes": processes, "leaves": entries}
    return PytreeSnapshot(
        process,
        processes,
        json.dumps(document, separators=(",", ":")).encode("utf-8"),
        chunks,
        dict(metadata or {}),
        _structure(entries),
    )


def _structure(entries: list[dict[str, Any]]) -> str:
    """The digest of the leaves' entries without the values of scalars and strings (process
    0's are stored; the others' may differ, as NumPy leaves' may)."""
    shape = [{key: item for key, item in entry.items() if key != "value"} for entry in entries]
    text = json.dumps(shape, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


_BIG_ENDIAN = sys.byteorder == "big"


def _aliases_device_memory(data: jax.Array) -> bool:
    """Whether NumPy's view of a device array is the device's memory (a CPU device's buffer,
    which a donation may reuse), rather than a host copy made for it (an accelerator's)."""
    return any(device.platform == "cpu" for device in data.devices())


def _copied(
    array: np.ndarray[Any, Any],
    key: tuple[str, Box],
    buffers: dict[tuple[str, Box], np.ndarray[Any, Any]] | None,
) -> np.ndarray[Any, Any]:
    """``array`` copied into host memory of ckptstore's (a reused buffer where one fits)."""
    buffer = None if buffers is None else buffers.get(key)
    if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
        buffer = np.empty(array.shape, array.dtype)
        if buffers is not None:
            buffers[key] = buffer
    np.copyto(buffer, array)
    return buffer


def _c_order(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _describe(sharding: Any) -> Any:
    """A sharding as JSON, for people (``ckptstore show``): a load takes the target's."""
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is not None and spec is not None:
        return {"mesh": {str(k): int(v) for k, v in mesh.shape.items()}, "spec": str(spec)}
    return {"type": type(sharding).__name__}


def write_shards(pending: PendingCheckpoint, snapshot: PytreeSnapshot) -> None:
    """Write this process's parts, its index and (process 0) the tree document."""
    parts, index = pack(snapshot.process, snapshot.chunks)
    for name, data in parts.items():
        pending.write(name, data)
    pending.write(index_shard(snapshot.process), index)
    if snapshot.process == 0:
        pending.write(TREE, snapshot.tree)


def write_snapshot(
    store: CheckpointStore,
    step: int,
    snapshot: PytreeSnapshot,
    timings: Mapping[str, float] | None = None,
    *,
    started: float | None = None,
    sequence: int | None = None,
    timeout_s: float = 600.0,
) -> Checkpoint:
    """Publish ``snapshot`` (every process's, when there are several) as ``step``.

    ``sequence``: with several processes, the number of this coordinated save
    (``next_sequence()``, taken by every process, in the same order, before its snapshot).
    """

    def write(pending: PendingCheckpoint) -> None:
        write_shards(pending, snapshot)
        if snapshot.process != 0:
            return  # the coordinator's manifest records its own timings
        for name, seconds in (timings or {}).items():
            pending.add_timing(name, seconds)
        if started is not None:
            pending.add_timing("to_commit_s", time.perf_counter() - started)

    if snapshot.processes == 1:
        with store.begin(step, snapshot.metadata) as pending:
            write(pending)
        assert pending.checkpoint is not None
        return pending.checkpoint
    if sequence is None:
        raise CheckpointStateError("a save of several processes needs its sequence number")
    collective = JaxCollective(f"ckptstore/save/{sequence}", timeout_s=timeout_s)
    return save_coordinated(
        store, step, write, collective, metadata=snapshot.metadata, agreement=snapshot.structure
    )


def next_sequence() -> int | None:
    """The number of the next coordinated save of this process (None with one process).

    Taken before anything that can fail, so that the processes of a job, which make the same
    saves in the same order, name each save's keys in the coordination service alike even when
    one of them fails before it writes."""
    return next(_SAVES) if jax.process_count() > 1 else None


def fail_together(
    store: CheckpointStore, step: int, error: BaseException, sequence: int, timeout_s: float
) -> None:
    """Take part in save ``sequence`` only to fail it: the other processes hear ``error`` at
    once (rather than wait ``timeout_s`` for this one), and nothing is published."""

    def write(pending: PendingCheckpoint) -> None:
        raise error

    collective = JaxCollective(f"ckptstore/save/{sequence}", timeout_s=timeout_s)
    with contextlib.suppress(CkptStoreError):
        save_coordinated(store, step, write, collective)


def save_pytree(
    store: CheckpointStore,
    step: int,
    tree: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    timeout_s: float = 600.0,
) -> Checkpoint:
    """Save ``tree`` as checkpoint ``step`` and publish it; return the checkpoint.

    Every process of a multi-process job calls it with the same tree (its own shards of each
    array); ``timeout_s`` bounds how long a process waits for the others. The manifest records
    ``snapshot_s`` (the host copies) beside the store's timings.
    """
    sequence = next_sequence()
    started = time.perf_counter()
    try:
        snapshot = snapshot_pytree(tree, metadata=metadata, copy=False)
    except Exception as exc:
        if sequence is not None:
            fail_together(store, step, exc, sequence, timeout_s)
        raise
    timings = {"snapshot_s": time.perf_counter() - started}
    return write_snapshot(store, step, snapshot, timings, sequence=sequence, timeout_s=timeout_s)
