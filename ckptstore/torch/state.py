"""A trainer's whole state to a checkpoint and back: model, optimizer, scheduler, data
position, RNGs and counters, bitwise exact.

Each component is an object with ``state_dict()``/``load_state_dict()`` (a module, an
optimizer, an LR scheduler, a resumable sampler), a random generator the trainer holds
(``torch.Generator``, ``numpy.random.Generator``, ``random.Random``: restored in place, by its
state), or a plain nested mapping. It is stored as two shards, ``<name>.safetensors`` (its
tensors) and ``<name>.json`` (everything else). A large component's tensors are split into
parts of about ``PART_SIZE`` bytes (``<name>.safetensors``, ``<name>.1.safetensors``, ...;
the manifest's ``tensor_parts`` metadata counts them), so that the storage writes one part
back while the next is written, and loads read parts in parallel. The RNG states go into
``rng.*``; the counters a long run keeps (samples read, successful and skipped updates,
tokens, ...) into the manifest's metadata, where ``ckptstore show`` prints them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import torch

from ckptstore.checkpoint import Checkpoint
from ckptstore.driver import Buffer
from ckptstore.errors import (
    InvalidInputError,
    InvalidMetadataError,
    ManifestCorruptError,
    ShardCorruptError,
    ShardNotFoundError,
)
from ckptstore.interface import CheckpointStore
from ckptstore.names import check_shard_name
from ckptstore.torch.agreement import agreed_checkpoint
from ckptstore.torch.codec import (
    decode_state,
    encode_state_chunks,
    encode_state_parts,
    is_generator,
    read_tensors,
    restore_generator,
    tensor_destinations,
)
from ckptstore.torch.rng import capture_rng, restore_rng

__all__ = [
    "PART_SIZE",
    "Snapshot",
    "Stateful",
    "load_state",
    "save_state",
    "snapshot_state",
    "write_snapshot",
]

RNG = "rng"
PART_SIZE = 64 * 1024 * 1024
"""A component's tensors start a new safetensors shard once the current one holds this many
bytes: the storage writes back one part while the next is written (a tensor is never split)."""
_PART_READERS = 4
"""Parts of one component read at the same time by ``load_state``."""
PARTS_KEY = "tensor_parts"
"""Manifest metadata: component name -> its number of tensor parts, for components with more
than one (absent: one part, ``<name>.safetensors``, as every checkpoint before parts had)."""


def part_shard(component: str, index: int) -> str:
    """The shard holding part ``index`` of a component's tensors."""
    return f"{component}.safetensors" if index == 0 else f"{component}.{index}.safetensors"


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict`` and ``load_state_dict`` (modules, optimizers, ...)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class Snapshot:
    """Encoded shards of a trainer state, owned by ckptstore (training may go on)."""

    def __init__(self, shards: dict[str, list[Buffer]], metadata: dict[str, Any]) -> None:
        self.shards = shards
        self.metadata = metadata

    @property
    def size(self) -> int:
        """Bytes held."""
        return sum(memoryview(c).nbytes for chunks in self.shards.values() for c in chunks)


def _check_components(components: Mapping[str, Any]) -> None:
    for name in components:
        check_shard_name(f"{name}.json")
        if name == RNG:
            raise InvalidInputError(f"component name {RNG!r} is reserved for the RNG states")


def snapshot_state(
    components: Mapping[str, Any],
    *,
    counters: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    rng: bool = True,
    copy: bool = True,
    buffers: dict[str, Any] | None = None,
) -> Snapshot:
    """Encode the state now into bytes ckptstore owns; the trainer may then change it.

    ``buffers`` (a dict kept by the caller from one snapshot to the next): host tensors the
    copies reuse when shape and dtype match, so that a snapshot is one copy, no allocation.
    """
    _check_components(components)
    shards: dict[str, list[Buffer]] = {}
    counts: dict[str, int] = {}
    for name, component in components.items():
        state = component.state_dict() if isinstance(component, Stateful) else component
        copier = None if buffers is None else _reusing(buffers, name)
        parts, skeleton = encode_state_parts(
            state,
            copy=copy,
            copier=copier,
            subject=f"component {name!r}",
            part_size=PART_SIZE,
            steady=_frozen_parameters(component),
        )
        for index, chunks in enumerate(parts or [[]]):  # no tensors: one empty shard
            shard = part_shard(name, index)
            if shard in shards:
                raise InvalidInputError(
                    f"component {name!r}: its tensor part {shard!r} has the name of another "
                    f"component's shard; rename one of the components",
                )
            shards[shard] = chunks
        if len(parts) > 1:
            counts[name] = len(parts)
        shards[f"{name}.json"] = [skeleton]
    if rng:
        tensors, skeleton = encode_state_chunks(capture_rng(), copy=copy)
        shards[f"{RNG}.safetensors"] = tensors
        shards[f"{RNG}.json"] = [skeleton]
    document = dict(metadata or {})
    reserved = sorted(document.keys() & {"components", "counters", PARTS_KEY})
    if reserved:
        raise InvalidMetadataError(
            f"metadata key {reserved[0]!r} is ckptstore.torch's own (it describes how the "
            f"state is stored); name yours otherwise"
        )
    document["components"] = sorted(components)
    if counts:
        document[PARTS_KEY] = counts
    if counters:
        document["counters"] = dict(counters)
    return Snapshot(shards, document)


def _frozen_parameters(component: Any) -> Callable[[torch.Tensor], bool] | None:
    """For a module: true of its frozen parameters' tensors (``requires_grad`` off: a base
    model under adapters, frozen embeddings, a reference model), which its state dict holds
    as detached tensors of the same memory. They go into tensor parts of their own, which an
    incremental save then shares from save to save instead of writing them again."""
    if not isinstance(component, torch.nn.Module):
        return None
    frozen = {_memory_of(p) for p in component.parameters() if not p.requires_grad}
    if not frozen:
        return None
    return lambda tensor: _memory_of(tensor) in frozen


def _memory_of(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a tensor is a view of: two tensors with this in common hold the same values."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        int(tensor.storage_offset()),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _reusing(buffers: dict[str, Any], component: str) -> Any:
    def copy_into(key: str, tensor: Any) -> Any:
        slot = f"{component}/{key}"
        host = buffers.get(slot)
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            host = _new_host_buffer(tensor)
            buffers[slot] = host
        host.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        if tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()
        return host

    return copy_into


def _new_host_buffer(tensor: Any) -> Any:
    pinned = tensor.device.type == "cuda"
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)


def write_snapshot(
    store: CheckpointStore,
    step: int,
    snapshot: Snapshot,
    timings: Mapping[str, float] | None = None,
    *,
    started: float | None = None,
) -> Checkpoint:
    """Write a snapshot's shards and publish them as ``step``.

    ``started`` (a ``time.perf_counter()`` value): record ``to_commit_s``, the time from then to
    the sealing of the manifest, just before the atomic publish.
    """
    with store.begin(step, snapshot.metadata) as pending:
        for name, chunks in snapshot.shards.items():
            pending.write(name, chunks)
        for name, seconds in (timings or {}).items():
            pending.add_timing(name, seconds)
        if started is not None:
            pending.add_timing("to_commit_s", time.perf_counter() - started)
    assert pending.checkpoint is not None
    return pending.checkpoint


def save_state(
    store: CheckpointStore,
    step: int,
    components: Mapping[str, Any],
    *,
    counters: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> Checkpoint:
    """Save a trainer's state as ``step``, synchronously; return the published checkpoint.

    The manifest records ``snapshot_s`` (the state's encoding, before the store's ``write_s``)
    and no ``blocked_s``: a synchronous save blocks the trainer for all of it, and
    ``blocked_s`` is recorded only by saves that go on in the background after it
    (``ckptstore.interval`` tells the two apart by it).
    """
    started = time.perf_counter()
    snapshot = snapshot_state(components, counters=counters, metadata=metadata, rng=rng, copy=False)
    return write_snapshot(store, step, snapshot, {"snapshot_s": time.perf_counter() - started})


def load_state(
    source: Checkpoint | CheckpointStore,
    components: Mapping[str, Any],
    *,
    map_location: Any = "cpu",
    rng: bool = True,
    group: Any = None,
) -> dict[str, Any]:
    """Restore ``components`` (and the RNGs) from one checkpoint; return its step and counters.

    ``source``: a checkpoint, or a store to load the latest of. In a multi-rank
    torch.distributed job, a store makes this a collective over ``group``: the coordinator
    alone resolves the latest and every rank loads that one (``agreed_checkpoint``); raises
    CheckpointNotFoundError if the store has none.

    Returns ``{"step": <the step loaded>, "counters": {...}}``, and for each plain mapping
    component its restored state under the component's name (a Stateful component gets
    ``load_state_dict``).

    Tensors are read straight into the component's own (a model's parameters and buffers, an
    optimizer's materialised state) when the stored state has the same keys and each tensor
    the same shape, dtype and device (CPU), so a load needs no second copy of the state in
    memory. Every byte is still verified, but a shard found damaged at its end has already been
    read into those tensors: after an IntegrityError, as after a ``load_state_dict`` that
    refuses a state (which copies what fits before it raises), load the components again
    before training on.
    """
    if isinstance(source, Checkpoint):
        checkpoint = source
    else:
        checkpoint = agreed_checkpoint(source, group=group)
    restored: dict[str, Any] = {"step": checkpoint.step}
    for name, component in components.items():
        present = component.state_dict() if isinstance(component, Stateful) else None
        state = _read_state(checkpoint, name, map_location, present)
        if isinstance(component, Stateful):
            component.load_state_dict(state)
        elif is_generator(component):
            if not restore_generator(component, state):
                raise InvalidInputError(
                    f"component {name!r} is a {type(component).__name__}, but step "
                    f"{checkpoint.step} holds a {type(state).__name__} under that name",
                    step=checkpoint.step,
                )
        else:
            restored[name] = state
    if rng and f"{RNG}.json" in checkpoint.shards:
        restore_rng(_read_state(checkpoint, RNG, None, None))
    counters = checkpoint.metadata.get("counters", {})
    restored["counters"] = dict(counters) if isinstance(counters, dict) else {}
    return restored


def _read_state(checkpoint: Checkpoint, name: str, map_location: Any, present: Any) -> Any:
    """One component's state, verified: each tensor read straight into the tensor that holds
    it now in ``present`` (the component's current state) when shape, dtype and place match,
    else into new memory."""
    skeleton = checkpoint.read(f"{name}.json")
    named = f"{checkpoint.url} step {checkpoint.step}: shard {name + '.json'!r}"
    into = tensor_destinations(skeleton, present, where=named) if present is not None else None
    shards = [part_shard(name, index) for index in range(_part_count(checkpoint, name))]

    def read_part(shard: str) -> dict[str, torch.Tensor]:
        with checkpoint.open(shard, checksum_thread=len(shards) == 1) as stream:
            where = f"{checkpoint.url} step {checkpoint.step}: shard {shard!r}"
            return read_tensors(stream, checkpoint.shards[shard].size, where=where, into=into)

    if len(shards) == 1:
        parts = [read_part(shards[0])]
    else:  # parts in parallel: one part's copy overlaps another's checksum and I/O waits
        with ThreadPoolExecutor(min(len(shards), _PART_READERS), "ckptstore-load") as pool:
            parts = list(pool.map(read_part, shards))
    tensors: dict[str, torch.Tensor] = {}
    for shard, part in zip(shards, parts, strict=True):
        if not tensors.keys().isdisjoint(part):
            raise ShardCorruptError(
                f"{checkpoint.url} step {checkpoint.step}: shard {shard!r} holds tensors that "
                f"an earlier part holds",
                step=checkpoint.step,
            )
        tensors.update(part)
    return decode_state(tensors, skeleton, map_location=map_location, where=named)


def _part_count(checkpoint: Checkpoint, name: str) -> int:
    counts = checkpoint.metadata.get(PARTS_KEY, {})
    count = counts.get(name, 1) if isinstance(counts, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ManifestCorruptError(
            f"{checkpoint.url} step {checkpoint.step}: metadata {PARTS_KEY!r} is not a map of "
            f"component names to part counts: {counts!r}",
            step=checkpoint.step,
        )
    missing = [
        part_shard(name, i) for i in range(count) if part_shard(name, i) not in checkpoint.shards
    ]
    if missing:
        raise ShardNotFoundError(
            f"{checkpoint.url} step {checkpoint.step}: component {name!r} has no shard "
            f"{missing[0]!r}",
            url=checkpoint.url,
            step=checkpoint.step,
            key=missing[0],
        )
    return count
