"""The standard workload: two saves, a dead attempt, retention, GC and a read, on any store.

It saves two checkpoints of several shards (one multipart-sized where the storage has
multipart uploads), leaves a dead attempt behind, lets it age past the grace period, runs a
retention pass that deletes, a GC that removes the dead attempt, and reads the latest
checkpoint back. The crash-point layer crashes it at every storage call (``crash_points``), the
power-loss layer cuts power at every change it makes (``power_loss``), the syscall trace records
what its driver asks of the kernel (``syscall_trace``); ``save``, ``push`` and ``pattern`` serve
every layer that saves.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

from ckptstore.adapters.directory import publish_directory
from ckptstore.conformance.faults import FaultPlan
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import InvariantViolation, Model, Saved
from ckptstore.driver import Capability
from ckptstore.manifest import Manifest
from ckptstore.retention import KeepLast
from ckptstore.store import Store

__all__ = [
    "AGE_PAST_GRACE",
    "GRACE",
    "MANY_PARTS",
    "MULTIPART_COMPLETION",
    "LocationMaker",
    "big_shard_size",
    "committing",
    "many_parts",
    "pattern",
    "push",
    "save",
    "standard_shards",
    "standard_workload",
    "write_directory",
]

GRACE = timedelta(hours=1)
MULTIPART_COMPLETION = "complete_multipart"
AGE_PAST_GRACE = 2 * GRACE.total_seconds()
"""How far the clock moves for dead attempts to be older than the grace period."""
LocationMaker = Callable[[], Location]
MANY_PARTS = 13
"""Parts of the big shard of the workload's second save (where the storage has multipart
uploads): a server that assembles parts in the wrong order (by name: 1, 10, 11, 12, 13, 2,
...; or by arrival) is only visible from part 10 on."""
BIG_TAIL = 123
"""The bytes of a big shard's last, short part."""
MANY_PARTS_UP_TO = 1024
"""The part size up to which the workload's second save has ``MANY_PARTS`` parts (``memory://``
with 1 KiB parts): every crash case runs the workload, so over HTTP (moto's 4 KiB parts, S3's
5 MiB) 11 more parts cost each case a round trip apiece and 22 more cases; there the
multipart probe's 13 parts, uploaded once, stand for it (a server's assembly is the probe's
to catch; the workload's many parts catch the library's own ordering)."""


def pattern(size: int, seed: int) -> bytes:
    """Deterministic, position-dependent bytes (a shifted copy is never equal)."""
    block = bytes((seed * 131 + i * 7) % 251 for i in range(251))
    return (block * (size // 251 + 1))[:size]


def big_shard_size(location: Location) -> int:
    """A size that takes a multipart upload of two parts (the last one short) where the
    storage has them: each crash case runs the whole workload, so each part costs twice."""
    strategy = location.base
    if Capability.MULTIPART not in strategy.capabilities:
        return 0
    part_size = int(getattr(strategy, "part_size", 0) or 0)
    return part_size + BIG_TAIL if part_size else 0


def many_parts(big: int, seed: int) -> bytes:
    """A shard of ``MANY_PARTS`` parts, where ``big`` (``big_shard_size``) is one part and a
    short one: each part's bytes its own, so parts in another order read back differently."""
    part = big - BIG_TAIL
    whole = b"".join(pattern(part, seed + n) for n in range(MANY_PARTS - 1))
    return whole + pattern(BIG_TAIL, seed + MANY_PARTS)


def standard_shards(step: int, big: int) -> dict[str, bytes]:
    """The shards the workload saves at ``step``; one of ``big`` bytes unless it is 0 (of
    ``MANY_PARTS`` parts at step 2 where parts are small, read back whole by the workload).

    Named as real trainers name files: a name that starts with ``.`` (torch DCP's
    ``.metadata``) and one with ``_`` (DCP's ``__0_0.distcp``), which some gateways and FUSE
    file systems hide; and a tree four directories deep (DeepSpeed's ``global_step``/
    ``zero`` layout).
    """
    shards = {
        "model/rank00000.bin": pattern(3000, step),
        "zero/global_step/layer_00/mp_rank_01/model_states.pt": pattern(2000, step + 1),
        ".metadata": f'{{"step": {step}}}'.encode(),
        "__0_0.distcp": b"",
    }
    if big:
        many = step == 2 and big - BIG_TAIL <= MANY_PARTS_UP_TO
        shards["optimizer/big.bin"] = many_parts(big, step + 2) if many else pattern(big, step + 2)
    return shards


@contextlib.contextmanager
def committing(store: Store, model: Model, saved: Saved) -> Iterator[None]:
    """While entered, the store saves ``saved`` (by any route that ends in its strategy's
    publish): the model is told it is in doubt, then committed.

    The checkpoint counts as committed the moment the strategy's publish returns (before the
    LATEST hint and retention run), the strictest reading of "when commit() returns".
    """
    model.save_started(saved)
    strategy = store.strategy
    publish = strategy.publish

    def publish_and_tell(manifest: Manifest) -> None:
        publish(manifest)
        model.save_committed(saved)

    strategy.publish = publish_and_tell  # type: ignore[method-assign]
    try:
        yield
    finally:
        del strategy.publish
    model.save_committed(saved)


def save(store: Store, model: Model, saved: Saved, *, pieces: int = 1) -> None:
    """Save ``saved`` through the store, telling the model when it is in doubt and committed
    (``committing``). ``pieces`` > 1: each shard given as a list of that many buffers (a
    snapshot's chunks: hashed, shared and written without being joined)."""
    shards: Mapping[str, Any] = saved.shards
    if pieces > 1:
        shards = {name: _split(blob, pieces) for name, blob in saved.shards.items()}
    with committing(store, model, saved):
        store.save(saved.step, shards, saved.metadata)


def _split(blob: bytes, pieces: int) -> list[memoryview]:
    """``blob`` as ``pieces`` consecutive views (some empty where it is short)."""
    view = memoryview(blob)
    cuts = [len(blob) * i // pieces for i in range(pieces + 1)]
    return [view[a:b] for a, b in itertools.pairwise(cuts)]


def write_directory(directory: str, shards: Mapping[str, bytes]) -> None:
    """Write ``shards`` as the files of ``directory`` (a trainer's checkpoint directory), each
    at its shard's name."""
    for name, blob in shards.items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as file:
            file.write(blob)


def push(store: Store, model: Model, saved: Saved, *, clone: bool, **options: Any) -> None:
    """``ckptstore push`` of ``saved``: its shards written as the files of a fresh directory,
    published by ``publish_directory`` (each file a clone where ``clone`` and the storage makes
    clones, else copied), the model told as ``save`` tells it. ``options``: the rest of
    ``publish_directory``'s."""
    with tempfile.TemporaryDirectory(prefix="ckptstore-push-") as directory:
        write_directory(directory, saved.shards)
        with committing(store, model, saved):
            publish_directory(
                store, saved.step, directory, metadata=saved.metadata, clone=clone, **options
            )


def standard_workload(location: Location, plan: FaultPlan, model: Model, big: int) -> Store:
    """Run the standard workload once with faults from ``plan``; return the store it used."""
    store, _ = location.open(plan)
    for step in (1, 2):
        save(store, model, Saved(step, standard_shards(step, big), {"step": step}))
    dead = Saved(3, {"model/rank00000.bin": pattern(1000, 3)}, {"step": 3})
    model.save_started(dead)
    pending = store.begin(3, dead.metadata)
    pending.write("model/rank00000.bin", dead.shards["model/rank00000.bin"])
    del pending  # its writer "dies": the attempt is never published nor aborted
    location.clock.advance(AGE_PAST_GRACE)
    listed = set(store.steps())
    hidden = sorted(set(model.committed) - listed)
    if hidden:
        raise InvariantViolation(
            "I2",
            f"the store does not list step(s) {hidden}, published a moment before: the "
            f"storage's listing omits what was just written (see the probes' listing checks)",
        )
    model.removal_started(listed - {max(listed)}, explicit=False)
    store.apply_retention(KeepLast(1))
    model.gc_started()
    store.gc(grace=GRACE)
    latest = store.latest()
    if latest is not None:
        for name in latest.names:
            latest.read(name)
    return store
