"""Incremental saves: a shard whose bytes an earlier checkpoint of the store holds is shared
with it, not written again, and stays readable as long as any checkpoint that lists it is
published (I10, docs/protocol.md §12).

Built for file systems whose driver makes hard links (``LinkingDriver``: ``file://``): the
new checkpoint gets a link of its own to the bytes; and for object stores that do
compare-and-swap (``s3://``, ``gs://``, ``az://``, versioned buckets too): blobs named by a
strong digest, used under leases (``ckptstore.commit.blob_leases``). Elsewhere an incremental
save is refused when the store is opened, with an error that says why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptstore.commit.base import CommitStrategy, FileId
from ckptstore.errors import InvalidOptionError
from ckptstore.manifest import Manifest
from ckptstore.shardbytes import ShardBytes

__all__ = ["StorageUse", "StrategySharing", "check_incremental", "storage_use"]

log = logging.getLogger(__name__)


def check_incremental(strategy: CommitStrategy[Any]) -> None:
    """Refuse (InvalidOptionError) incremental saves on a store that cannot share shards."""
    if not strategy.shares_shards:
        raise InvalidOptionError(
            f"{strategy.url}: incremental saves are built for file systems with hard links "
            f"(file://) and object stores with compare-and-swap (s3://, gs://, az://, and "
            f"their +versioned forms); this store ({strategy.name}) writes every shard: open "
            f"it without incremental"
        )


class StrategySharing:
    """An attempt's sharing through its commit strategy (``PendingCheckpoint(sharing=)``)."""

    def __init__(self, strategy: CommitStrategy[Any], step: int, attempt: str) -> None:
        self.strategy = strategy
        self.step = step
        self.attempt = attempt
        self.digest_algorithm = strategy.sharing_digest
        """The strong digest that names shared bytes (object stores), or None."""

    def share(
        self, name: str, crc32c: str, size: int, data: ShardBytes, digest: str | None = None
    ) -> Mapping[str, str] | None:
        """The shard made stored bytes that are exactly ``data`` (its locator), or None."""
        return self.strategy.share_shard(self.step, self.attempt, name, crc32c, size, data, digest)

    def index(self, step: int, attempt: str, shards: Mapping[str, tuple[str, int]]) -> None:
        """Make an attempt's sealed shards (their bytes durable; by name, their CRC32C and
        size) found by later saves; never raises (an index not made only costs a later save
        a write). Indexed at the seal, from the attempt's own staging files, so that what is
        indexed is what this save wrote, and ranks that joined the attempt index their own."""
        try:
            self.strategy.index_shards(step, attempt, shards)
        except Exception:
            log.warning(
                "%s: step %d's shards were not indexed for sharing", self.strategy.url, step,
                exc_info=True,
            )  # fmt: skip


@dataclass
class StorageUse:
    """What checkpoints hold on storage, counting bytes they share once."""

    shared: dict[tuple[int, int], int] = field(default_factory=dict)
    """By (step, epoch): the bytes of its shards that another listed checkpoint shares."""
    stored: int = 0
    """The bytes the listed checkpoints hold together, each stored file counted once."""
    listed: int = 0
    """The sum of the listed checkpoints' sizes (what they would hold without sharing)."""


def storage_use(strategy: CommitStrategy[Any], manifests: Iterable[Manifest]) -> StorageUse:
    """How the ``manifests``' checkpoints share their shards' stored files (one stat per
    shard where the storage says which file a shard is; elsewhere nothing is shared)."""
    use = StorageUse()
    files: dict[FileId, set[tuple[int, int]]] = {}
    sizes: dict[FileId, int] = {}
    shards: list[tuple[tuple[int, int], int, FileId | None]] = []
    for manifest in manifests:
        key = (manifest.step, manifest.epoch)
        ids = strategy.shard_files(manifest)
        use.shared[key] = 0
        for record in manifest.shards:
            use.listed += record.size
            file_id = ids.get(record.name)
            shards.append((key, record.size, file_id))
            if file_id is None:
                use.stored += record.size
                continue
            files.setdefault(file_id, set()).add(key)
            sizes[file_id] = record.size
    use.stored += sum(sizes.values())
    for key, size, file_id in shards:
        if file_id is not None and len(files[file_id]) > 1:
            use.shared[key] += size
    return use
