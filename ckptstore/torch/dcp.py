"""torch.distributed.checkpoint storage over any ckptstore store.

``CkptStoreWriter`` and ``CkptStoreReader`` let ``dcp.save``, ``dcp.async_save`` and
``dcp.load`` use the ckptstore protocol on every backend. The coordinator begins the attempt
in ``prepare_global_plan`` and hands its id to every rank through the plans; each rank writes
one shard, ``__<rank>.distcp``, into that attempt (tensors as raw bytes, DCP's own byte items
as given; in an incremental save, the tensors unchanged since the writer's last save go into
``__<rank>_steady.distcp``, shared with it); the coordinator's ``finish`` gathers every rank's
receipts from the write results, checks coverage, stores DCP's metadata as JSON
(``dcp-metadata.json``) and publishes. Loading reads the manifest's shards, checksummed,
through their locators.

Tensors and the metadata are stored as bytes and JSON. DCP's planner serialises non-tensor
values itself (``BYTE_IO`` items, ``torch.save``) and deserialises them on load with
``torch.load(weights_only=False)``, which runs whatever code a pickle names: so the reader
first loads each such item with ``weights_only=True`` (plain data, tensors, and the types
``torch.serialization.add_safe_globals`` allows), refuses anything else with
``UnsafePickleError`` before any of it runs, and hands the planner a fresh ``torch.save`` of
what it loaded, never the stored bytes. ``CkptStoreReader(..., weights_only=False)`` opts out,
for a store whose every writer is trusted: a CRC32C proves that bytes are the ones committed,
not who committed them.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import pickle
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptstore.checkpoint import Checkpoint
from ckptstore.checksum import crc32c_hex
from ckptstore.driver import BytesLike
from ckptstore.errors import (
    CheckpointStateError,
    InvalidInputError,
    ManifestCorruptError,
    UnsafePickleError,
)
from ckptstore.interface import CheckpointStore
from ckptstore.jsonload import JSONDocumentError, load_json
from ckptstore.manifest import MAX_MANIFEST_BYTES, ShardRecord
from ckptstore.names import check_step
from ckptstore.pending import PendingCheckpoint
from ckptstore.shardbytes import LazyBytes
from ckptstore.torch.agreement import agreed_checkpoint
from ckptstore.torch.dcp_staging import ReusingStager

__all__ = ["CkptStoreReader", "CkptStoreWriter"]

METADATA_SHARD = "dcp-metadata.json"


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> Any:
    """The part of ``tensor`` that starts at ``offsets`` and spans ``lengths``, per dimension
    (a view: what a load item asks of a stored chunk)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _shard_name(rank: int, part: str = "") -> str:
    return f"__{rank}{part}.distcp"


class _SaveState(threading.local):
    """What one save under way keeps between DCP's calls: each save runs on one thread (the
    caller's, or an ``async_save`` thread), so saves in flight at once never share it."""

    def __init__(self) -> None:
        self.pending: PendingCheckpoint | None = None
        self.requested: int | None = None
        self.step: int | None = None
        self.snapshot_s: float | None = None


class CkptStoreWriter(StorageWriter):
    """A DCP StorageWriter whose every ``dcp.save`` publishes one checkpoint of ``store`` (one
    commit for all ranks), or nothing.

    The step is DCP's ``checkpoint_id`` (``dcp.save(state, checkpoint_id=7,
    storage_writer=writer)``; also ``"7"`` or ``"<store url>#step=7"``), else ``step``. One
    writer serves every save of a run, ``dcp.async_save`` included, several in flight at once.

    For ``dcp.async_save`` the writer is also the stager (DCP's ``AsyncStager``): it copies the
    state into host memory reused from save to save, never into memory a save in flight still
    writes from, and the manifest records how long that copy blocked the trainer (``snapshot_s``
    and ``blocked_s``, as ``AsyncSaver`` does). ``close()`` frees that memory.
    """

    _synchronize_after_execute = False  # ``stage`` returns a finished copy: nothing to wait for

    def __init__(
        self,
        store: CheckpointStore,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.store = store
        self.default_step = None if step is None else check_step(step)
        self.metadata = dict(metadata or {})
        self.rank = 0
        self.is_coordinator = True
        self._save = _SaveState()
        self._last_step = self.default_step
        self._stager: ReusingStager | None = None
        self._history: dict[int, dict[tuple[str, tuple[int, ...]], str]] = {}
        """By rank: the CRC32C of each tensor item of this writer's last incremental save."""
        self._history_lock = threading.Lock()

    @property
    def step(self) -> int | None:
        """The step of the save under way on this thread (else of the last save begun)."""
        return self._save.step if self._save.step is not None else self._last_step

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's call before a save that names a ``checkpoint_id`` (none: the default step)."""
        self._save.pending = None
        self._save.snapshot_s = None
        self._save.requested = (
            None if checkpoint_id is None else step_from_checkpoint_id(self.store, checkpoint_id)
        )

    def _next_step(self) -> int | None:
        requested = self._save.requested
        return self.default_step if requested is None else requested

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        self._save.step, self._save.requested = self._next_step(), None  # this save's, used up
        self._last_step = self._save.step

    @property
    def should_synchronize_after_execute(self) -> bool:
        """DCP's AsyncStager question: nothing to wait for after ``stage`` returns."""
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s copy of the state (the part that blocks the trainer), timed."""
        if self._stager is None:
            self._stager = ReusingStager()
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a finished copy."""

    def close(self) -> None:
        """Free the host memory kept for the next ``dcp.async_save``'s copy."""
        if self._stager is not None:
            self._stager.close()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        step = self._save.step
        if step is None:
            raise InvalidInputError(
                f"{self.store.url}: which step does this save publish? Pass it to dcp.save as "
                f"checkpoint_id=<step>, or to CkptStoreWriter(store, step)"
            )
        self._save.pending = self.store.begin(step, self.metadata, world_size=len(plans))
        attempt = self._save.pending.attempt
        return [  # the coordinator's step and attempt reach every rank with its plan
            dataclasses.replace(plan, storage_data={"attempt": attempt, "rank": rank, "step": step})
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        attempt, rank = plan.storage_data["attempt"], plan.storage_data["rank"]
        step = plan.storage_data["step"]
        pending = self._save.pending
        if pending is None:
            pending = self.store.join(step, attempt)
        results: list[WriteResult] = []
        if plan.items:
            if pending.shares:
                written = self._write_sharing(pending, plan, planner, rank)
            else:
                written = self._write_streamed(pending, plan.items, planner, rank)
            pending.seal()  # the shards are durable before their receipts travel
            for item, info in written:  # receipts travel to the coordinator in the results
                results.append(WriteResult(item.index, info["length"], info))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _item_bytes(self, item: Any, planner: SavePlanner, info: dict[str, Any]) -> BytesLike:
        """One item's bytes to store (a tensor's, in host memory; a BYTE_IO item's as given),
        its dtype and shape recorded in ``info``."""
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            return (  # resolve_data gives BYTE_IO items as BytesIO, or as bytes
                memoryview(data.getbuffer())
                if isinstance(data, io.BytesIO)
                else cast(BytesLike, data)
            )
        assert isinstance(data, torch.Tensor)
        if self._stager is not None and self._save.snapshot_s is None:
            self._save.snapshot_s = self._stager.seconds_for(data)
        tensor = data.detach().to("cpu").contiguous()
        info["dtype"] = str(tensor.dtype).removeprefix("torch.")
        info["shape"] = list(tensor.shape)
        return _tensor_bytes(tensor)

    def _write_streamed(
        self, pending: PendingCheckpoint, items: Sequence[Any], planner: SavePlanner, rank: int
    ) -> list[tuple[Any, dict[str, Any]]]:
        """``items``, one after another, into the rank's shard: each item's bytes are written
        before the next is resolved."""
        name = _shard_name(rank)
        offset = 0
        entries: list[tuple[Any, dict[str, Any]]] = []
        with pending.open_shard(name) as shard:
            for item in items:
                info: dict[str, Any] = {"shard": name, "offset": offset}
                info["length"] = shard.write(self._item_bytes(item, planner, info))
                offset += info["length"]
                entries.append((item, info))
        entries[0][1]["receipt"] = dataclasses.asdict(shard.close())
        return entries

    def _write_sharing(
        self, pending: PendingCheckpoint, plan: SavePlan, planner: SavePlanner, rank: int
    ) -> list[tuple[Any, dict[str, Any]]]:
        """An incremental save's items: the tensors whose bytes are those of this writer's
        last save (by CRC32C) go into a shard of their own, ``__<rank>_steady.distcp``, which
        is shared with that save's where it holds the same bytes; the rest are streamed into
        ``__<rank>.distcp``. The CRC32C only sorts the items: what is shared is decided by
        the store on the whole shard's bytes (docs/protocol.md §12). Each item is resolved
        (copied to host memory, where it is not there already) again for each pass over it,
        so that no more than one item's copy is held at a time."""
        with self._history_lock:
            before = self._history.get(rank, {})
        now: dict[tuple[str, tuple[int, ...]], str] = {}
        steady: list[tuple[Any, dict[str, Any], int]] = []
        changing: list[Any] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                changing.append(item)
                continue
            info: dict[str, Any] = {}
            view = memoryview(self._item_bytes(item, planner, info)).cast("B")
            key = (item.index.fqn, tuple(item.index.offset or ()))
            now[key] = crc32c_hex(view)
            if before.get(key) == now[key]:
                steady.append((item, info, view.nbytes))
            else:
                changing.append(item)
            del view  # a copy (from a GPU, of a strided tensor) is not held
        with self._history_lock:
            self._history[rank] = now
        entries: list[tuple[Any, dict[str, Any]]] = []
        if steady:
            name, offset = _shard_name(rank, "_steady"), 0
            for item, info, size in steady:
                info.update(shard=name, offset=offset, length=size)
                offset += size
                entries.append((item, info))
            again = LazyBytes(
                (size, functools.partial(self._bytes_again, item, planner))
                for item, _, size in steady
            )
            steady[0][1]["receipt"] = dataclasses.asdict(pending.write(name, again))
        if changing:
            entries += self._write_streamed(pending, changing, planner, rank)
        return entries

    def _bytes_again(self, item: Any, planner: SavePlanner) -> memoryview:
        return memoryview(self._item_bytes(item, planner, {})).cast("B")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pending = self._save.pending
        if pending is None:
            raise CheckpointStateError("finish() without prepare_global_plan() on the coordinator")
        if self._save.snapshot_s is not None:  # staged by this writer for dcp.async_save
            pending.add_timing("snapshot_s", self._save.snapshot_s)
            pending.add_timing("blocked_s", self._save.snapshot_s)
        storage: dict[MetadataIndex, Any] = {}
        receipts = []
        for rank_results in results:
            for result in rank_results:
                info = dict(result.storage_data)
                receipt = info.pop("receipt", None)
                if receipt is not None and receipt["name"] not in {r.name for r in pending.records}:
                    receipts.append(ShardRecord(**receipt))
                storage[result.index] = info
        pending.add_receipts(receipts)
        metadata.storage_data = storage
        pending.write(METADATA_SHARD, json.dumps(_encode_metadata(metadata)).encode("utf-8"))
        pending.publish()
        self._save.pending = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def storage_meta(self) -> StorageMeta | None:
        step = self._next_step()  # DCP asks before set_up_storage_writer
        return (
            None if step is None else StorageMeta(checkpoint_id=checkpoint_id_of(self.store, step))
        )


class CkptStoreReader(StorageReader):
    """A DCP StorageReader that loads one checkpoint of ``store`` on every rank.

    The step is DCP's ``checkpoint_id`` if ``dcp.load`` is given one, else ``step``, else the
    latest: in a multi-rank job the coordinator alone resolves the latest and tells every rank
    (ranks that each asked could load different checkpoints), so ``dcp.load`` through this
    reader is then a collective over ``group`` (the process group given to ``dcp.load``; in a
    ``no_dist`` load in a multi-rank job, name the step). ``loaded`` is the checkpoint the
    last load read.

    Non-tensor values (DCP's ``BYTE_IO`` items, which DCP's planner unpickles with
    ``torch.load(weights_only=False)``) are first loaded as ``torch.load(weights_only=True)``
    does: plain data, tensors and the types ``torch.serialization.add_safe_globals`` allows.
    Anything else raises ``UnsafePickleError`` and nothing in it runs; the planner is handed a
    fresh ``torch.save`` of the value loaded, never the stored bytes. ``weights_only=False``
    hands the stored bytes over as they are: only for a store whose every writer you trust
    (anyone who can write to the store can recompute its CRC32Cs and manifest checksum), or
    for a custom planner that stores ``BYTE_IO`` items in a format of its own.
    """

    def __init__(
        self,
        store: CheckpointStore,
        step: int | None = None,
        *,
        group: Any = None,
        weights_only: bool = True,
    ) -> None:
        super().__init__()
        self.store = store
        self.default_step = None if step is None else check_step(step)
        self.group = group
        self.weights_only = weights_only
        self.loaded: Checkpoint | None = None
        self.bytes_read = 0
        """Bytes read from storage by this reader's loads (whole blocks: what a load cost)."""
        self._requested: int | None = None
        self._storage: dict[MetadataIndex, Any] = {}

    def _open(self) -> Checkpoint:
        if self.loaded is None:
            raise CheckpointStateError("read_data() before read_metadata()")
        return self.loaded

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's call before a load that names a ``checkpoint_id`` (none: the default step)."""
        self.loaded = None
        self._requested = (
            None if checkpoint_id is None else step_from_checkpoint_id(self.store, checkpoint_id)
        )

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Decide which checkpoint this load reads (every rank the same one), and read its
        DCP metadata."""
        if kwargs.get("rank") is not None:  # DCP's fallback after a failed read: no such thing
            raise CheckpointStateError(
                f"{self.store.url}: a ckptstore checkpoint has one DCP metadata for every rank; "
                f"there is no rank-local metadata to fall back to"
            )
        step = self.default_step if self._requested is None else self._requested
        self._requested = None
        self.loaded = agreed_checkpoint(self.store, step, group=self.group)
        checkpoint = self.loaded
        if METADATA_SHARD not in checkpoint.shards:
            raise ManifestCorruptError(
                f"{self.store.url}: step {checkpoint.step} was not saved by torch.distributed."
                f"checkpoint (no {METADATA_SHARD})",
                step=checkpoint.step,
            )
        try:
            document = load_json(
                checkpoint.read(METADATA_SHARD), max_bytes=MAX_MANIFEST_BYTES, max_depth=64
            )
            if not isinstance(document, dict):
                raise JSONDocumentError("is not a JSON object")
            return _decode_metadata(document)
        except (JSONDocumentError, KeyError, TypeError, AttributeError) as exc:
            problem = exc if isinstance(exc, JSONDocumentError) else f"is malformed ({exc!r})"
            raise ManifestCorruptError(
                f"{self.store.url}: step {checkpoint.step}: shard {METADATA_SHARD!r} {problem}",
                step=checkpoint.step,
            ) from exc

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read each item's bytes, and only those (a ranged read, checked block by block),
        straight into the tensor it restores where the stored layout allows."""
        checkpoint = self._open()
        for item in plan.items:
            info = self._storage[item.storage_index]
            shard, offset, length = info["shard"], info["offset"], info["length"]
            if item.type == LoadItemType.BYTE_IO:
                blob = self._read(checkpoint, shard, offset, length)
                if self.weights_only:
                    where = f"{self.store.url} step {checkpoint.step}: {item.storage_index.fqn}"
                    planner.load_bytes(item, _plain_data(blob, where))
                else:
                    planner.load_bytes(item, io.BytesIO(blob))
                continue
            target = planner.resolve_tensor(item).detach()
            wanted = torch.Size(item.lengths)
            if target.size() != wanted:
                raise ManifestCorruptError(
                    f"{shard}: {item.storage_index.fqn}: the load plan asks for "
                    f"{tuple(wanted)} of it, into a tensor of {tuple(target.size())}"
                )
            self._read_tensor(checkpoint, info, item, target)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read(
        self, checkpoint: Checkpoint, shard: str, offset: int, length: int, into: Any = None
    ) -> memoryview:
        record = checkpoint.shards.get(shard)
        if record is not None and record.block_size:
            blocks = record.block_range(offset, length)
            self.bytes_read += min(blocks.stop * record.block_size, record.size) - (
                blocks.start * record.block_size
            )
        elif record is not None:
            self.bytes_read += record.size
        return checkpoint.read_range(shard, offset, length, into)

    def _read_tensor(
        self, checkpoint: Checkpoint, info: dict[str, Any], item: Any, target: torch.Tensor
    ) -> None:
        dtype = _dtype(info["dtype"], f"{info['shard']}: {item.storage_index.fqn}")
        shape = [int(d) for d in info["shape"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if math.prod(shape) * itemsize != info["length"]:
            raise ManifestCorruptError(
                f"{info['shard']}: {item.storage_index.fqn}: {info['length']} bytes cannot hold "
                f"{info['dtype']} {shape}"
            )
        span = _contiguous_span(shape, list(item.storage_offsets), list(item.lengths))
        if span is None:  # a strided part: read the stored chunk, then take the part
            blob = self._read(checkpoint, info["shard"], info["offset"], info["length"])
            stored = _tensor_from_bytes(blob, info["dtype"], shape)
            target.copy_(_narrow(stored, item.storage_offsets, item.lengths))
            return
        start, count = span
        offset, length = info["offset"] + start * itemsize, count * itemsize
        if (
            target.dtype == dtype
            and target.device.type == "cpu"
            and target.is_contiguous()
            and not target.is_neg()
        ):  # straight into the destination
            if length:
                self._read(checkpoint, info["shard"], offset, length, _byte_view(target))
            return
        blob = self._read(checkpoint, info["shard"], offset, length)
        target.copy_(_tensor_from_bytes(blob, info["dtype"], list(item.lengths)))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _plain_data(blob: BytesLike, where: str) -> io.BytesIO:
    """``blob`` (a ``torch.save`` of a value) as a fresh ``torch.save`` of what
    ``torch.load(weights_only=True)`` makes of it: whatever unpickles it next (DCP's planner,
    with ``weights_only=False``) meets only types that loader allows, never stored code."""
    try:
        value = torch.load(io.BytesIO(blob), weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = " ".join(
            line.strip()
            for line in str(exc).splitlines()
            if line.strip()
            and not line.startswith(("Weights only load failed", "Check the doc", "Please file"))
        )
        raise UnsafePickleError(
            f"{where}: refused to unpickle this non-tensor value: it is not plain data "
            f"({reason[:300] or 'torch.load(weights_only=True) refuses it'}); nothing in it "
            f"ran. If every writer of this store is trusted, load with "
            f"CkptStoreReader(..., weights_only=False); to allow a type of your own, "
            f"torch.serialization.add_safe_globals([YourType])"
        ) from None
    fresh = io.BytesIO()
    torch.save(value, fresh)
    fresh.seek(0)
    return fresh


def _dtype(name: object, where: str) -> torch.dtype:
    """The torch dtype a stored name names (a stored name is data: never any other attribute
    of ``torch``)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ManifestCorruptError(f"{where}: {name!r} is not a torch dtype")
    return dtype


def checkpoint_id_of(store: CheckpointStore, step: int) -> str:
    """The DCP checkpoint id naming ``step`` of ``store``."""
    return f"{store.url}#step={step}"


def step_from_checkpoint_id(store: CheckpointStore, checkpoint_id: object) -> int:
    """The step a DCP ``checkpoint_id`` names: ``7``, ``"7"``, or ``"<store url>#step=7"``."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return check_step(checkpoint_id)
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else None
    if isinstance(text, str):
        url, marker, step_text = text.rpartition("#step=")
        if not marker:
            step_text = text
        elif url != store.url:
            raise InvalidInputError(
                f"checkpoint_id {text!r} names a step of {url}, not of this store ({store.url})",
                url=store.url,
            )
        if step_text.isascii() and step_text.isdigit():
            return check_step(int(step_text))
    raise InvalidInputError(
        f"checkpoint_id {checkpoint_id!r} is not a step of {store.url}: give the step number "
        f"(7 or '7') or '{store.url}#step=7'",
        url=store.url,
    )


def _contiguous_span(
    shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int] | None:
    """(first element, element count) of the part of a C-ordered array of ``shape`` that
    starts at ``offsets`` and spans ``lengths``, if that part is one run of elements; else None.

    It is one run when every dimension after the first one taken partly (more than one index)
    is taken whole: e.g. rows 8..15 of a matrix, or one row's columns 2..5.
    """
    if len(shape) != len(offsets) or len(shape) != len(lengths):
        raise ManifestCorruptError(
            f"a load item of {len(lengths)} dims for a {len(shape)}-dim chunk"
        )
    for dim, (offset, length, size) in enumerate(zip(offsets, lengths, shape, strict=True)):
        if offset < 0 or length < 0 or offset + length > size:
            raise ManifestCorruptError(f"a load item outside the stored chunk (dim {dim})")
    count = math.prod(lengths)
    if count == 0:
        return 0, 0
    partial = next((d for d, length in enumerate(lengths) if length > 1), len(shape) - 1)
    if any(offsets[d] or lengths[d] != shape[d] for d in range(partial + 1, len(shape))):
        return None
    stride, start = 1, 0
    for dim in reversed(range(len(shape))):
        start += offsets[dim] * stride
        stride *= shape[dim]
    return start, count


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, in place."""
    flat: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(flat)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array)


def _tensor_from_bytes(blob: BytesLike, dtype: str, shape: list[int]) -> torch.Tensor:
    target_dtype = _dtype(dtype, "a stored tensor")
    if not blob:
        return torch.empty(shape, dtype=target_dtype)
    raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return raw.view(target_dtype).reshape(shape)


# -- DCP metadata as JSON ------------------------------------------------------------------


def _index(index: MetadataIndex) -> dict[str, Any]:
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
    }


def _unindex(data: dict[str, Any]) -> MetadataIndex:
    return MetadataIndex(data["fqn"], data["offset"], data["index"])


def _encode_metadata(metadata: Metadata) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes"}
            continue
        properties = entry.properties
        entries[fqn] = {
            "kind": "tensor",
            "dtype": str(properties.dtype).removeprefix("torch."),
            "requires_grad": properties.requires_grad,
            "size": list(entry.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks],
        }
    return {
        "format": "ckptstore.dcp-metadata",
        "version": metadata.version,
        "state_dict_metadata": entries,
        "planner_data": _plain(metadata.planner_data),
        "storage_data": [
            {"index": _index(index), "info": info}
            for index, info in (metadata.storage_data or {}).items()
        ],
    }


def _plain(value: Any) -> Any:
    """Planner data (tuples of path parts) as JSON lists, marked so they come back tuples."""
    if isinstance(value, dict):
        return {"__dict__": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if isinstance(value, (tuple, list)):
        return {"__tuple__" if isinstance(value, tuple) else "__list__": [_plain(v) for v in value]}
    return value


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if "__dict__" in value:
            return {_unplain(k): _unplain(v) for k, v in value["__dict__"]}
        if "__tuple__" in value:
            return tuple(_unplain(v) for v in value["__tuple__"])
        if "__list__" in value:
            return [_unplain(v) for v in value["__list__"]]
    return value


def _decode_metadata(document: dict[str, Any]) -> Metadata:
    if document.get("format") != "ckptstore.dcp-metadata":
        raise ManifestCorruptError("not a ckptstore DCP metadata document")
    entries: dict[str, Any] = {}
    for fqn, entry in document["state_dict_metadata"].items():
        if entry["kind"] == "bytes":
            entries[fqn] = BytesStorageMetadata()
            continue
        entries[fqn] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=_dtype(entry["dtype"], f"DCP metadata of {fqn}"),
                requires_grad=entry["requires_grad"],
            ),
            size=torch.Size(entry["size"]),
            chunks=[
                ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                for c in entry["chunks"]
            ],
        )
    storage = {_unindex(e["index"]): e["info"] for e in document["storage_data"]}
    return Metadata(
        state_dict_metadata=entries,
        planner_data=_unplain(document["planner_data"]),
        storage_data=storage,
        version=document.get("version"),
    )
