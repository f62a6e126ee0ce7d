"""Shared blobs on a file system: a published checkpoint holds its own hard link to every
shard's bytes, so no deletion elsewhere (retention, GC of the area) can free them.

The blob area (``blobs/<algorithm>/<first 2 hex>/<hex>-<size>``) is only an index: each
entry is one more link to a file some checkpoint published, found by the shard's digest.
An incremental save links an entry into its staging directory instead of writing the bytes
(``share``); after a save publishes, its shards are linked into the area (``index``). GC
removes an entry whose link count is 1 (no checkpoint, no staging directory holds it) once it
is older than the grace period (``sweep``). Safety rests on the kernel's link count, not on a
clock or a listing (docs/protocol.md §12.2): a GC that unlinks an entry a writer has just
linked removes only the index, and the writer's link keeps the bytes.
"""

from __future__ import annotations

import logging
import re

from ckptstore.checksum import Crc32c
from ckptstore.commit.base import GcItem, GcReport
from ckptstore.digest import ALGORITHMS
from ckptstore.driver import LinkingDriver
from ckptstore.errors import ObjectNotFoundError, StorageError, TargetExistsError

__all__ = ["BLOB_AREA", "FileBlobArea", "blob_path"]

log = logging.getLogger(__name__)

BLOB_AREA = "blobs"
"""The root entry that holds the blob area."""
_READ_PIECE = 8 * 1024 * 1024
"""A shared entry is read back this much at a time to check its CRC32C."""
_ENTRY = re.compile(r"([0-9a-f]{64})-(0|[1-9][0-9]{0,18})", re.ASCII)


def blob_path(digest: str, size: int) -> str:
    """The area entry of a shard's bytes: its digest (``<algorithm>:<hex>``) and size."""
    algorithm, _, value = digest.partition(":")
    if algorithm not in ALGORITHMS or not _ENTRY.fullmatch(f"{value}-{size}"):
        raise ValueError(f"not a blob: {digest!r} of {size} bytes")
    return f"{BLOB_AREA}/{algorithm}/{value[:2]}/{value}-{size}"


class FileBlobArea:
    """The blob area of one store on a file system whose driver makes hard links."""

    def __init__(self, driver: LinkingDriver) -> None:
        self.driver = driver

    def available(self, digest: str, size: int) -> bool:
        """True if the area has a regular file for ``digest`` with ``size`` bytes."""
        path = blob_path(digest, size)
        try:
            self.driver.links(path)  # a regular file (a symbolic link is not)
            return self.driver.stat(path).size == size
        except StorageError:
            return False

    def share(self, digest: str, size: int, target: str, crc32c: str) -> bool:
        """Make ``target`` (a new name in a staging directory) a link to the bytes an earlier
        checkpoint published with ``digest`` and ``size``, read back and found to have the
        CRC32C ``crc32c`` of the bytes the save holds; False, nothing left at ``target``,
        where the area has no such entry, or one that cannot be linked or holds other bytes
        (a file changed in place, an operator's replacement): then write them."""
        source = blob_path(digest, size)
        if not self._real_directories(source):
            return False
        try:
            linked = self.driver.link(source, target)
        except ObjectNotFoundError:
            return False
        except TargetExistsError:
            raise
        except StorageError as exc:  # EPERM (protected hard links), EMLINK, a stray entry
            log.info("%s: not sharing %s (%s); writing the shard", self.driver.url, source, exc)
            return False
        problem = None
        if linked != size:  # a digest is trusted only with its size (a truncated entry)
            problem = f"holds {linked} bytes, its name says {size}"
        else:
            found = self._crc32c(target)
            if found != crc32c:
                problem = f"holds bytes of CRC32C {found}, the shard's are {crc32c}"
        if problem is None:
            return True
        self.driver.unlink(target)
        log.warning(
            "%s: blob entry %s %s (changed after it was saved?): writing the shard, and "
            "indexing it in the entry's place",
            self.driver.url, source, problem,
        )  # fmt: skip
        try:  # only the index's name: a checkpoint that links the file keeps it (and says so)
            self.driver.unlink(source)
        except StorageError as exc:
            log.info("%s: %s not removed (%s)", self.driver.url, source, exc)
        return False

    def _crc32c(self, path: str) -> str:
        """The CRC32C of the file at ``path``, read whole (a save shares only bytes it
        checked: a shared file changed in place would otherwise spread to every save)."""
        crc = Crc32c()
        with self.driver.open_read(path) as stream:
            while chunk := stream.read(_READ_PIECE):
                crc.update(chunk)
        return crc.hexdigest()

    def _real_directories(self, path: str) -> bool:
        """True if every directory on ``path`` under the store's root is a directory, not a
        symbolic link (never followed out of the store)."""
        parts = path.split("/")[:-1]
        try:
            return all(
                self.driver.stat("/".join(parts[: depth + 1])).is_dir for depth in range(len(parts))
            )
        except StorageError:
            return False

    def index(self, digest: str, size: int, source: str) -> None:
        """Link ``source`` (a sealed shard file: its bytes durable) into the area under its
        digest, for later saves to share; an existing entry is kept. Best effort: a failure
        is logged, and only costs a later save the write it would have saved."""
        target = blob_path(digest, size)
        try:
            if not self._make_parents(target):
                log.info("%s: the blob area is not a directory: nothing indexed", self.driver.url)
                return
            self.driver.link(source, target)
        except TargetExistsError:
            return
        except StorageError as exc:
            log.info("%s: %s not indexed for sharing (%s)", self.driver.url, source, exc)

    def _make_parents(self, path: str) -> bool:
        """Make the directories ``path`` needs; False (nothing made below it) where one of
        them is anything but a directory (a symbolic link is never followed)."""
        parts = path.split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            try:
                self.driver.mkdir(directory)
            except TargetExistsError:
                if not self.driver.stat(directory).is_dir:
                    return False
        return True

    def sweep(self, now: float, report: GcReport) -> None:
        """Remove (or, on a dry run, report) every area entry no checkpoint links any more
        and that is older than the grace period (by its inode's change time, on the file
        system's clock ``now``). Only entries named as the area names them are touched."""
        for algorithm in self._listed(BLOB_AREA):
            if algorithm not in ALGORITHMS:
                continue
            for fan in self._listed(f"{BLOB_AREA}/{algorithm}"):
                folder = f"{BLOB_AREA}/{algorithm}/{fan}"
                for name in self._listed(folder):
                    found = _ENTRY.fullmatch(name)
                    if found is None or not found.group(1).startswith(fan):
                        continue  # not the area's: left alone
                    self._sweep_entry(f"{folder}/{name}", int(found.group(2)), now, report)

    def _sweep_entry(self, path: str, size: int, now: float, report: GcReport) -> None:
        try:
            info = self.driver.links(path)
        except StorageError:
            return  # gone meanwhile, or not a regular file: not the area's
        if info.count > 1:
            return  # a checkpoint (or a save under way) holds the bytes
        item = GcItem(kind="blob", name=path, age_s=max(0.0, now - info.changed), size=size)
        if now - info.changed < report.grace_s:
            report.kept_young.append(item)
            return
        report.removed.append(item)
        if report.dry_run:
            return
        try:
            self.driver.unlink(path)
        except ObjectNotFoundError:
            return

    def _listed(self, path: str) -> list[str]:
        """The names in the directory ``path``; none if it is anything else (a symbolic link
        planted in the area is never followed out of the store)."""
        try:
            if not self.driver.stat(path).is_dir:
                return []
            return self.driver.listdir(path)
        except StorageError:
            return []
