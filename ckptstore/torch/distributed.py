"""Multi-rank saves over torch.distributed: every rank writes its shards, one commit.

The coordinator (rank 0 of the group) begins the attempt and shares its id; every rank writes
its own shards into that attempt (``Store.join``); the receipts (name, size, CRC32C, locator)
are gathered to the coordinator, which checks coverage (every rank reported, no shard twice)
and publishes through the ckptstore protocol. A rank that fails, or dies, before its receipts
reach the coordinator means nothing is published; the collective then fails on every rank
(within the process group's timeout, or at once under torchrun, which stops the other ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import CkptStoreError
from ckptstore.interface import CheckpointStore
from ckptstore.manifest import ShardRecord
from ckptstore.pending import ShardData

__all__ = ["save_sharded"]

COORDINATOR = 0


def save_sharded(
    store: CheckpointStore,
    step: int,
    shards: Mapping[str, ShardData],
    *,
    metadata: Mapping[str, Any] | None = None,
    group: Any = None,
) -> Checkpoint:
    """Save this rank's ``shards`` as part of checkpoint ``step``; a collective call.

    Every rank of ``group`` calls it with its own shards (names must differ across ranks).
    Returns the published checkpoint on every rank, or raises on every rank.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    coordinator = dist.get_global_rank(group, COORDINATOR) if group is not None else COORDINATOR
    pending = None
    begun: list[Any] = [None]
    if rank == COORDINATOR:
        try:
            pending = store.begin(step, metadata, world_size=world)
            begun = [("ok", pending.attempt)]
        except CkptStoreError as exc:
            begun = [("error", f"rank {rank}: {exc}")]
    dist.broadcast_object_list(begun, src=coordinator, group=group)
    status, value = begun[0]
    if status != "ok":
        raise CkptStoreError(f"step {step} not saved: {value}", step=step)
    if pending is None:
        pending = store.join(step, value)

    try:
        for name, data in shards.items():
            pending.write(name, data)
        receipts = pending.seal()  # durable before the receipts travel
        mine: tuple[str, Any] = ("ok", [dataclasses.asdict(r) for r in receipts])
    except CkptStoreError as exc:
        mine = ("error", f"rank {rank}: {exc}")
    gathered: list[Any] | None = [None] * world if rank == COORDINATOR else None
    dist.gather_object(mine, gathered, dst=coordinator, group=group)

    outcome: list[Any] = [None]
    if rank == COORDINATOR:
        assert gathered is not None
        outcome = [_publish(pending, gathered)]
    dist.broadcast_object_list(outcome, src=coordinator, group=group)
    status, value = outcome[0]
    if status != "ok":
        raise CkptStoreError(f"step {step} not saved: {value}", step=step)
    return store.get(step)


def _publish(pending: Any, gathered: list[Any]) -> tuple[str, Any]:
    errors = [payload[1] for payload in gathered if payload is None or payload[0] != "ok"]
    if errors:
        pending.abort()
        return "error", "; ".join(str(e) for e in errors)
    try:
        for rank, (_, receipts) in enumerate(gathered):
            if rank != COORDINATOR:
                pending.add_receipts(ShardRecord(**receipt) for receipt in receipts)
        return "ok", pending.publish().step
    except CkptStoreError as exc:
        if pending.state == "open":
            pending.abort()
        return "error", str(exc)
