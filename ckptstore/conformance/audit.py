"""A raw view of what a strategy keeps in storage, for the suite's leftover check (I7) only.

Never used to find checkpoints: readers trust only published manifests. It lives here, not in
the strategies, because only the suite asks it: each built-in strategy has its audit below
(``audit_of``), and a third-party strategy that wants the leftover check implements
``StorageAudit`` itself (or registers one with ``register_audit``); without one the suite says
it cannot look for what a crash left behind.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.commit.blob_leases import BlobName
from ckptstore.commit.conditional_put import (
    EPOCHS,
    LATEST_KEY,
    MANIFESTS,
    PROBE_PREFIX,
    ConditionalPutCommit,
)
from ckptstore.commit.rename import (
    DATA_DIR,
    EPOCH_RECORD,
    EPOCHS_DIR,
    GC_CLOCK_PREFIX,
    MANIFEST_NAME,
    RenameCommit,
    directories_of,
)
from ckptstore.commit.version_pin import VersionPinCommit, versioned_name
from ckptstore.errors import ObjectNotFoundError
from ckptstore.fencing import CLOCK_MARKER
from ckptstore.manifest import Manifest
from ckptstore.names import checkpoint_token, epoch_token

__all__ = ["StorageAudit", "audit_of", "register_audit"]


class StorageAudit(abc.ABC):
    """Every raw name under a store, and which of them a published checkpoint owns."""

    @property
    def fixed_names(self) -> frozenset[str]:
        """Raw names that belong to the store itself rather than to a checkpoint (the hint)."""
        return frozenset()

    def is_scratch(self, name: str) -> bool:
        """Whether raw ``name`` is one of the store's short-lived probes (a clock reading),
        which no checkpoint ever refers to: a change to it changes no checkpoint."""
        return False

    @abc.abstractmethod
    def stored_names(self, manifest: Manifest) -> set[str]:
        """Every raw name (as ``raw_names`` lists them) that belongs to a published checkpoint."""

    def lineage_names(self) -> set[str]:
        """The raw names of the store's epoch records (kept forever, like the hint)."""
        return set()

    @abc.abstractmethod
    def raw_names(self) -> set[str]:
        """Every name in storage under the store: files and directories, or objects and uploads."""


class _OfStrategy(StorageAudit):
    """An audit of a built-in strategy, whose own names (the hint) it declares."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @property
    def fixed_names(self) -> frozenset[str]:
        return frozenset(self.strategy.fixed_names)


class RenameAudit(_OfStrategy):
    """A file system store: every file and directory below its root."""

    def __init__(self, strategy: RenameCommit) -> None:
        super().__init__(strategy)
        self.driver = strategy.driver

    def stored_names(self, manifest: Manifest) -> set[str]:
        final = checkpoint_token(manifest.step, manifest.epoch)
        names = {final, f"{final}/{MANIFEST_NAME}", f"{final}/{DATA_DIR}"}
        for directory in directories_of(manifest):
            names.add(f"{final}/{DATA_DIR}/{directory}")
        names.update(f"{final}/{DATA_DIR}/{record.name}" for record in manifest.shards)
        return names

    def lineage_names(self) -> set[str]:
        names = set()
        for epoch in self.strategy.listed_epochs():
            record = f"{EPOCHS_DIR}/{epoch_token(epoch)}"
            names |= {record, f"{record}/{EPOCH_RECORD}"}
        # The directory is the store's once made, even empty: a taker that died before its
        # rename leaves it so after GC took the staging (removing it would fail the mkdir of a
        # taker staging in it at that moment).
        return names | ({EPOCHS_DIR} if names or self._is_dir(EPOCHS_DIR) else set())

    def _is_dir(self, path: str) -> bool:
        try:
            return self.driver.stat(path).is_dir
        except ObjectNotFoundError:
            return False

    def is_scratch(self, name: str) -> bool:
        return name.startswith(GC_CLOCK_PREFIX)

    def raw_names(self) -> set[str]:
        names: set[str] = set()
        pending = [""]
        while pending:
            directory = pending.pop()
            try:
                children = self.driver.listdir(directory)
            except ObjectNotFoundError:
                continue
            for child in children:
                if not directory and child.startswith(GC_CLOCK_PREFIX):
                    continue  # a running gc's clock reading, not part of the store
                path = f"{directory}/{child}" if directory else child
                names.add(path)
                if self._is_dir(path):
                    pending.append(path)
        return names


class ObjectStoreAudit(_OfStrategy):
    """An object store: every key under the prefix, and every incomplete multipart upload."""

    strategy: ConditionalPutCommit

    def is_scratch(self, name: str) -> bool:
        return name.startswith((PROBE_PREFIX, f"{EPOCHS}{CLOCK_MARKER}"))

    def stored_names(self, manifest: Manifest) -> set[str]:
        names = {self.strategy.manifest_key(manifest.step, manifest.epoch)}
        names.update(record.locator["key"] for record in manifest.shards)
        for record in manifest.shards:  # a shared blob's lease is the checkpoint's too (§12.3)
            if "blob" in record.locator:
                names.add(BlobName.parse(record.locator["blob"]).lease_key)
        return names

    def lineage_names(self) -> set[str]:
        return {self.strategy.epoch_key(epoch) for epoch in self.strategy.listed_epochs()}

    def raw_names(self) -> set[str]:
        return {info.key for info in self.strategy.driver.list("")} | self.upload_names()

    def upload_names(self) -> set[str]:
        """The incomplete uploads, each named ``<key> (upload <id>)``."""
        uploads = self.strategy.incomplete_uploads("")
        return {f"{upload.key} (upload {upload.upload_id})" for upload in uploads}


class VersionPinAudit(ObjectStoreAudit):
    """A versioned bucket: every version (``key@version``) but the current hint, manifests
    and epoch records, which are named by key."""

    def stored_names(self, manifest: Manifest) -> set[str]:
        names = {self.strategy.manifest_key(manifest.step)}
        names.update(
            versioned_name(r.locator["key"], r.locator["version_id"]) for r in manifest.shards
        )
        return names

    def raw_names(self) -> set[str]:
        names = set()
        for version in self.strategy.driver.list_versions(""):
            current = version.is_latest and not version.is_delete_marker
            fixed = version.key == LATEST_KEY or version.key.startswith((MANIFESTS, EPOCHS))
            if current and fixed:
                names.add(version.key)
            else:
                names.add(versioned_name(version.key, version.version_id))
        return names | self.upload_names()


AuditFactory = Callable[[Any], StorageAudit]

_AUDITS: list[tuple[type[CommitStrategy[Any]], AuditFactory]] = [
    (VersionPinCommit, VersionPinAudit),  # before its base class
    (ConditionalPutCommit, ObjectStoreAudit),
    (RenameCommit, RenameAudit),
]


def register_audit(strategy_class: type[CommitStrategy[Any]], factory: AuditFactory) -> None:
    """Audit ``strategy_class`` (and its subclasses) with ``factory(strategy)``; checked
    before the built-in audits, so a subclass that stores differently can bring its own."""
    _AUDITS.insert(0, (strategy_class, factory))


def audit_of(strategy: CommitStrategy[Any]) -> StorageAudit | None:
    """The audit of ``strategy``: itself if it implements StorageAudit, else the registered
    one for its class, else None (the suite cannot look for leftovers there)."""
    if isinstance(strategy, StorageAudit):
        return strategy
    for strategy_class, factory in _AUDITS:
        if isinstance(strategy, strategy_class):
            return factory(strategy)
    return None
