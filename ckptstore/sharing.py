"""Incremental saves: a shard whose bytes an earlier checkpoint of the store holds is shared
with it, not written again, and stays readable as long as any checkpoint that lists it is
published (I10, docs/protocol.md §12).

Built for file systems whose driver makes hard links (``LinkingDriver``: ``file://``): the
new checkpoint gets a link of its own to the bytes. Elsewhere an incremental save is refused
when the store is opened, with an error that says why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.errors import InvalidOptionError
from ckptstore.manifest import Manifest

__all__ = ["StrategySharing", "check_incremental"]

log = logging.getLogger(__name__)


def check_incremental(strategy: CommitStrategy[Any]) -> None:
    """Refuse (InvalidOptionError) incremental saves on a store that cannot share shards."""
    if not strategy.shares_shards:
        raise InvalidOptionError(
            f"{strategy.url}: incremental saves are built for file systems with hard links "
            f"(file://) so far; this store ({strategy.name}) writes every shard: open it "
            f"without incremental"
        )


class StrategySharing:
    """An attempt's sharing through its commit strategy (``PendingCheckpoint(sharing=)``)."""

    def __init__(
        self, strategy: CommitStrategy[Any], step: int, attempt: str, algorithm: str
    ) -> None:
        self.strategy = strategy
        self.step = step
        self.attempt = attempt
        self.algorithm = algorithm
        """The digest that names a blob (the store's recorded digests' where it records any:
        no shard is hashed twice)."""

    def available(self, digest: str, size: int) -> bool:
        """True if a published checkpoint's bytes are indexed under ``digest`` and ``size``
        (a hint: ``share`` may still find them gone)."""
        return self.strategy.shard_available(digest, size)

    def share(
        self, name: str, digest: str, size: int, *, replacing: bool = False
    ) -> Mapping[str, str] | None:
        """The shard made of bytes a published checkpoint holds (its locator), or None;
        ``replacing``: what this attempt began writing as the shard is dropped first."""
        return self.strategy.share_shard(
            self.step, self.attempt, name, digest, size, replacing=replacing
        )

    def index(self, manifest: Manifest, digests: Mapping[str, str]) -> None:
        """Make a published checkpoint's shards found by later saves, by ``digests`` (or
        the digests the manifest records); never raises (the checkpoint is published: an
        index not made only costs a later save a write)."""
        try:
            self.strategy.index_shards(manifest, digests)
        except Exception:
            log.warning(
                "%s: step %d's shards were not indexed for sharing", self.strategy.url,
                manifest.step, exc_info=True,
            )  # fmt: skip
