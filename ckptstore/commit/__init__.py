"""Commit strategies: how the protocol publishes atomically on each family of drivers."""

from ckptstore.commit.base import CommitStrategy, GcItem, GcReport, ShardSink
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.rename import RenameCommit

__all__ = [
    "CommitStrategy",
    "ConditionalPutCommit",
    "GcItem",
    "GcReport",
    "RenameCommit",
    "ShardSink",
]
