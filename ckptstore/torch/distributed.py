"""Multi-rank saves over torch.distributed: every rank writes its shards, one commit.

The protocol is ``ckptstore.coordinated``'s, over the group. The coordinator (rank 0 of the
group) begins the attempt and shares its id; every rank writes
its own shards into that attempt (``Store.join``); the receipts (name, size, CRC32C, locator)
are gathered to the coordinator, which checks coverage (every rank reported, no shard twice)
and publishes through the ckptstore protocol. A rank that fails, or dies, before its receipts
reach the coordinator means nothing is published; the collective then fails on every rank
(within the process group's timeout, or at once under torchrun, which stops the other ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ckptstore.checkpoint import Checkpoint
from ckptstore.coordinated import COORDINATOR, save_coordinated
from ckptstore.interface import CheckpointStore
from ckptstore.pending import PendingCheckpoint, ShardData

__all__ = ["TorchCollective", "save_sharded"]


class TorchCollective:
    """The ranks of a torch.distributed group as a ``ckptstore.coordinated.Collective``."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._coordinator = (
            dist.get_global_rank(group, COORDINATOR) if group is not None else COORDINATOR
        )

    def broadcast(self, value: Any) -> Any:
        carried = [value]
        dist.broadcast_object_list(carried, src=self._coordinator, group=self.group)
        return carried[0]

    def gather(self, value: Any) -> list[Any] | None:
        gathered: list[Any] | None = [None] * self.size if self.rank == COORDINATOR else None
        dist.gather_object(value, gathered, dst=self._coordinator, group=self.group)
        return gathered


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

    def write(pending: PendingCheckpoint) -> None:
        for name, data in shards.items():
            pending.write(name, data)

    return save_coordinated(store, step, write, TorchCollective(group), metadata=metadata)
