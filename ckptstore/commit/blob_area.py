"""Shared shards on a file system: a published checkpoint holds its own hard link to every
shard's bytes, so no deletion elsewhere (retention, GC of the area) can free them.

The blob area (``blobs/crc32c/<first 2 hex>/<crc32c>-<size>/<entry id>``) is only an index:
each entry is one more link to a shard file some save wrote and sealed, found by the shard's
CRC32C and size (which every save computes anyway). An incremental save links a candidate
entry into its staging directory and compares it, byte for byte, with the bytes it holds
(``share``): equality is exact, so no digest is needed and no collision can pass; a shard
whose CRC32C and size no entry has is written without any further hashing. Once sealed, the
shards a save wrote are linked into the area (``index``). GC removes an entry whose link
count is 1 (no checkpoint, no staging directory holds it) once it is older than the grace
period (``sweep``). Safety rests on the kernel's link count, not on a clock or a listing
(docs/protocol.md §12.2): a GC that unlinks an entry a writer has just linked removes only
the index, and the writer's link keeps the bytes.
"""

from __future__ import annotations

import logging
import re
from typing import BinaryIO

from ckptstore import names
from ckptstore.checksum import Crc32c
from ckptstore.commit.base import GcItem, GcReport
from ckptstore.driver import LinkingDriver
from ckptstore.errors import (
    InvalidShardNameError,
    ObjectNotFoundError,
    StorageError,
    TargetExistsError,
)
from ckptstore.shardbytes import ShardBytes

__all__ = ["BLOB_AREA", "FileBlobArea", "bucket_path"]

log = logging.getLogger(__name__)

BLOB_AREA = "blobs"
"""The root entry that holds the blob area."""
_BUCKETS = f"{BLOB_AREA}/crc32c"
_BUCKET = re.compile(r"([0-9a-f]{8})-(0|[1-9][0-9]{0,18})", re.ASCII)
_READ_PIECE = 8 * 1024 * 1024
"""A candidate entry is read back this much at a time, compared with the save's bytes."""
_ENTRIES_PER_BUCKET = 2
"""A save indexes its shard where a bucket holds fewer entries (several: the same bytes
indexed by saves that ran at once, or, rarely, other bytes of the same CRC32C and size)."""


def bucket_path(crc32c: str, size: int) -> str:
    """The area's directory of the entries of ``size`` bytes whose CRC32C is ``crc32c``."""
    if not _BUCKET.fullmatch(f"{crc32c}-{size}"):
        raise ValueError(f"not a shard's CRC32C and size: {crc32c!r}, {size}")
    return f"{_BUCKETS}/{crc32c[:2]}/{crc32c}-{size}"


def _is_entry_id(name: str) -> bool:
    try:
        return names.check_attempt_id(name) == name
    except InvalidShardNameError:
        return False


class FileBlobArea:
    """The blob area of one store on a file system whose driver makes hard links."""

    def __init__(self, driver: LinkingDriver) -> None:
        self.driver = driver

    def share(self, crc32c: str, size: int, target: str, data: ShardBytes) -> bool:
        """Make ``target`` (a new name in a staging directory) a link to a sealed shard file
        holding exactly ``data`` (its CRC32C ``crc32c``), read back through the new link and
        compared byte for byte; False, nothing left at ``target``, where no entry holds those
        bytes: then write them. An entry whose bytes no longer have its bucket's CRC32C (a
        file changed in place, an operator's replacement) is unlinked from the index (only
        the index's name: a checkpoint that links the file keeps it, and ``verify`` says it
        is damaged)."""
        bucket = bucket_path(crc32c, size)
        for entry in self._entries(bucket):
            source = f"{bucket}/{entry}"
            try:
                self.driver.link(source, target)
            except ObjectNotFoundError:
                continue  # removed by GC since the listing
            except TargetExistsError:
                raise
            except StorageError as exc:  # EPERM (protected hard links), EMLINK, a stray entry
                log.info("%s: not sharing %s (%s)", self.driver.url, source, exc)
                continue
            try:
                verdict = self._compare(target, data, crc32c)
            except (StorageError, OSError) as exc:  # EIO, ESTALE: an entry that cannot serve
                verdict = f"cannot be read back ({exc})"
            if verdict is None:
                return True
            self.driver.unlink(target)
            if verdict:  # damaged or unreadable: not the bytes its bucket says
                log.warning(
                    "%s: blob entry %s %s (changed after it was saved?): not shared, and "
                    "removed from the index",
                    self.driver.url, source, verdict,
                )  # fmt: skip
                try:
                    self.driver.unlink(source)
                except StorageError as exc:
                    log.info("%s: %s not removed (%s)", self.driver.url, source, exc)
        return False

    def _compare(self, path: str, data: ShardBytes, crc32c: str) -> str | None:
        """None if the file at ``path`` holds exactly ``data``; else "" where it holds other
        bytes of the same CRC32C and size (a collision: a good entry for other bytes), or
        what is wrong with it (not its bucket's bytes: damaged).

        Equal bytes have ``data``'s CRC32C, so the file is only compared, read into a reused
        buffer (``bytearray == buffer`` is a memcmp); it is checksummed only when it differs,
        to tell a collision from damage."""
        whole = bytearray(_READ_PIECE)
        with self.driver.open_read(path) as stream:
            for piece in data.pieces(_READ_PIECE):
                buffer = whole if piece.nbytes == _READ_PIECE else bytearray(piece.nbytes)
                if _fill(stream, buffer) != piece.nbytes or buffer != piece:
                    break
            else:
                if not stream.read(1):
                    return None
        crc = Crc32c()
        with self.driver.open_read(path) as stream:
            while chunk := stream.read(_READ_PIECE):
                crc.update(chunk)
        if crc.size != data.nbytes:
            return f"holds {crc.size} bytes, its bucket says {data.nbytes}"
        found = crc.hexdigest()
        return "" if found == crc32c else f"holds bytes of CRC32C {found}, its bucket says {crc32c}"

    def index(self, crc32c: str, size: int, source: str) -> None:
        """Link ``source`` (a sealed shard file: its bytes durable) into the area under its
        CRC32C and size, for later saves to share, unless its bucket holds enough entries
        already. Best effort: a failure is logged, and only costs a later save the write it
        would have saved."""
        bucket = bucket_path(crc32c, size)
        try:
            if not self._make_directories(bucket):
                log.info("%s: the blob area is not a directory: nothing indexed", self.driver.url)
                return
            if self._regular_entries(bucket) >= _ENTRIES_PER_BUCKET:
                return
            self.driver.link(source, f"{bucket}/{names.new_attempt_id()}")
        except StorageError as exc:
            log.info("%s: %s not indexed for sharing (%s)", self.driver.url, source, exc)

    def _make_directories(self, path: str) -> bool:
        """Make ``path`` and the directories above it; False (nothing made below it) where
        one of them is anything but a directory (a symbolic link is never followed)."""
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            directory = "/".join(parts[:depth])
            try:
                self.driver.mkdir(directory)
            except TargetExistsError:
                if not self.driver.stat(directory).is_dir:
                    return False
        return True

    def _entries(self, bucket: str) -> list[str]:
        """The entries of ``bucket`` named as the area names them; none where the bucket or
        a directory above it is not a directory."""
        parts = bucket.split("/")
        for depth in range(1, len(parts)):
            if not self._is_directory("/".join(parts[:depth])):
                return []
        return [name for name in self._listed(bucket) if _is_entry_id(name)]

    def _regular_entries(self, bucket: str) -> int:
        """How many entries of ``bucket`` are files (planted directories or FIFOs named like
        entries do not fill a bucket)."""
        found = 0
        for entry in self._entries(bucket):
            try:
                self.driver.links(f"{bucket}/{entry}")
            except StorageError:
                continue
            found += 1
        return found

    def _is_directory(self, path: str) -> bool:
        try:
            return self.driver.stat(path).is_dir
        except StorageError:
            return False

    def sweep(self, now: float, report: GcReport) -> None:
        """Remove (or, on a dry run, report) every area entry no checkpoint links any more
        and that is older than the grace period (by its inode's change time, on the file
        system's clock ``now``), and the buckets left empty. Only entries named as the area
        names them are touched."""
        if not self._is_directory(BLOB_AREA):
            return
        for fan in self._listed(_BUCKETS):
            for name in self._listed(f"{_BUCKETS}/{fan}"):
                found = _BUCKET.fullmatch(name)
                if found is None or not found.group(1).startswith(fan):
                    continue  # not the area's: left alone
                bucket = f"{_BUCKETS}/{fan}/{name}"
                entries = [e for e in self._listed(bucket) if _is_entry_id(e)]
                for entry in entries:
                    self._sweep_entry(f"{bucket}/{entry}", int(found.group(2)), now, report)
                self._remove_if_empty(bucket, report)
            if re.fullmatch(r"[0-9a-f]{2}", fan):
                self._remove_if_empty(f"{_BUCKETS}/{fan}", report)
        self._remove_if_empty(_BUCKETS, report)
        self._remove_if_empty(BLOB_AREA, report)

    def _remove_if_empty(self, directory: str, report: GcReport) -> None:
        """``rmdir``: only an empty directory goes (a save indexing into it meanwhile keeps
        it, or finds it gone and indexes nothing), never a symbolic link's target."""
        if report.dry_run or not self._is_directory(directory):
            return
        try:
            self.driver.rmdir(directory)
        except StorageError:
            pass

    def _sweep_entry(self, path: str, size: int, now: float, report: GcReport) -> None:
        try:
            info = self.driver.links(path)
        except StorageError:
            return  # gone meanwhile, or not a regular file: not the area's
        if info.count > 1:
            return  # a checkpoint (or a save under way) holds the bytes
        item = GcItem(
            "blob", path, max(0.0, now - info.changed), size, why="no checkpoint links it"
        )
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


def _fill(stream: BinaryIO, buffer: bytearray) -> int:
    """Read from ``stream`` until ``buffer`` is full or the stream ends; the bytes read."""
    view = memoryview(buffer)
    got = 0
    while got < len(buffer):
        count = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not count:
            break
        got += count
    return got
