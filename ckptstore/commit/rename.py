"""Publish by renaming a fully fsynced staging directory onto a step name that must not exist.

Layout under the store's root directory (DESIGN §4.1)::

    LATEST                                  hint: the newest published step
    step-<020d>/manifest.json               published checkpoint (the name is the commit)
    step-<020d>/data/<shard name>
    step-<020d>.pending-<attempt>/          staging of one attempt, a sibling of the final name
    .trash-<...>/                           unpublished, being deleted
    .LATEST.tmp-<...>                       a LATEST pointer being written

Commit: every shard written and fsynced; the manifest written last and fsynced; every staging
directory fsynced, deepest first; ``rename_noreplace(staging, final)``; the root fsynced. A
published directory always holds a manifest, so even a plain ``rename`` fallback fails on it
rather than replacing it.

A shard's fsync waits for its data to reach the disk. To let that writeback overlap the
writing of the next shards, a closed shard file stays open with its writeback started; the
seal (before the manifest, or before a rank sends its receipts) fsyncs them all. At most
``_UNSYNCED_LIMIT`` files of an attempt wait so, the oldest being fsynced first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, BinaryIO, TypeVar

from ckptstore.commit.base import CommitStrategy, GcItem, GcReport, ShardProblem, ShardSink
from ckptstore.driver import Capability, FileSystemDriver
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ManifestCorruptError,
    ObjectNotFoundError,
    ShardExistsError,
    ShardMissingError,
    StorageError,
    TargetExistsError,
)
from ckptstore.manifest import MAX_MANIFEST_BYTES, Manifest, ShardRecord
from ckptstore.names import new_attempt_id, parse_step_token, step_token

__all__ = ["RenameCommit"]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
LATEST_NAME = "LATEST"
PENDING_MARK = ".pending-"
TRASH_PREFIX = ".trash-"
LATEST_TMP_PREFIX = ".LATEST.tmp-"
_UNSYNCED_LIMIT = 64
_RenameT = TypeVar("_RenameT", bound="RenameCommit")


class _UnsyncedFiles:
    """The closed shard files of one attempt whose writeback is started but not waited for.

    ``seal`` fsyncs and closes them all, and from then on a file added late (a shard that was
    still being written) is fsynced at once. A failed fsync is remembered: the attempt's data
    may be lost, so every later seal of it fails too.
    """

    def __init__(self, driver: FileSystemDriver) -> None:
        self._driver = driver
        self._files: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._state = "open"
        self._failure: StorageError | None = None

    def add(self, path: str, handle: int) -> None:
        """Start the file's writeback and keep it; fsync the oldest when too many wait."""
        with self._lock:
            if self._state == "discarded":
                self._driver.close(handle)
                return
            self._files.append((path, handle))
            if self._state == "sealed":
                self._sync_locked(len(self._files))
                return
            try:
                self._driver.start_writeback(handle)
            except StorageError:
                log.debug("starting the writeback of %s failed", path, exc_info=True)
            if len(self._files) > _UNSYNCED_LIMIT:
                self._sync_locked(len(self._files) - _UNSYNCED_LIMIT)

    def seal(self) -> None:
        """Make every file added so far durable, or raise why one may not be."""
        with self._lock:
            if self._state == "open":
                self._state = "sealed"
            self._sync_locked(len(self._files))

    def _sync_locked(self, count: int) -> None:
        if self._failure is not None:
            self._close_all_locked()
            raise self._failure
        for _ in range(count):
            _path, handle = self._files.pop(0)
            try:
                self._driver.fsync(handle)
            except StorageError as exc:
                self._failure = exc
                self._driver.close(handle)
                self._close_all_locked()  # the attempt cannot publish: close the rest too
                raise
            self._driver.close(handle)

    def discard(self) -> None:
        """Close every file without waiting for it (the attempt is abandoned)."""
        with self._lock:
            self._state = "discarded"
            self._close_all_locked()

    def _close_all_locked(self) -> None:
        files, self._files = self._files, []
        for path, handle in files:
            try:
                self._driver.close(handle)
            except OSError:
                log.debug("closing %s of an abandoned attempt failed", path, exc_info=True)


class _FileShardSink(ShardSink):
    def __init__(
        self,
        driver: FileSystemDriver,
        unsynced: _UnsyncedFiles,
        path: str,
        locator: str,
        handle: int,
    ) -> None:
        self._driver = driver
        self._unsynced = unsynced
        self._path = path
        self._locator = locator
        self._handle: int | None = handle

    def write(self, data: memoryview) -> None:
        assert self._handle is not None
        self._driver.write(self._handle, data)

    def close(self) -> Mapping[str, str]:
        assert self._handle is not None
        handle, self._handle = self._handle, None
        self._unsynced.add(self._path, handle)
        return {"path": self._locator}

    def abort(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                self._driver.close(handle)
            except OSError:
                log.debug("closing %s after abort failed", self._path, exc_info=True)


class RenameCommit(CommitStrategy[FileSystemDriver]):
    """The POSIX rename protocol: atomic no-replace rename of a durable staging directory."""

    name = "posix-rename"
    required_capabilities = frozenset({Capability.RENAME_NOREPLACE, Capability.DURABLE_FSYNC})
    fixed_names = frozenset({LATEST_NAME})

    def __init__(self, driver: FileSystemDriver) -> None:
        super().__init__(driver)
        self._unsynced: dict[tuple[int, str], _UnsyncedFiles] = {}
        self._unsynced_lock = threading.Lock()

    def with_driver(self: _RenameT, driver: Any) -> _RenameT:
        clone = super().with_driver(driver)
        clone._unsynced = {}
        clone._unsynced_lock = threading.Lock()
        return clone

    def open_root(self, *, create: bool) -> None:
        self.driver.ensure_root(create)

    def _unsynced_files(self, step: int, attempt: str) -> _UnsyncedFiles:
        with self._unsynced_lock:
            files = self._unsynced.get((step, attempt))
            if files is None:
                files = self._unsynced[step, attempt] = _UnsyncedFiles(self.driver)
            return files

    # -- writing -------------------------------------------------------------------------

    @staticmethod
    def staging_dir(step: int, attempt: str) -> str:
        """The staging directory's name for an attempt."""
        return f"{step_token(step)}{PENDING_MARK}{attempt}"

    def begin(self, step: int, attempt: str) -> None:
        staging = self.staging_dir(step, attempt)
        self.driver.mkdir(staging)
        self.driver.mkdir(f"{staging}/{DATA_DIR}")

    def open_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None = None
    ) -> ShardSink:
        base = f"{self.staging_dir(step, attempt)}/{DATA_DIR}"
        segments = name.split("/")
        for depth in range(1, len(segments)):
            directory = f"{base}/{'/'.join(segments[:depth])}"
            try:
                self.driver.mkdir(directory)
            except TargetExistsError:
                if not self.driver.stat(directory).is_dir:
                    raise ShardExistsError(
                        f"shard {name!r} needs directory {'/'.join(segments[:depth])!r}, "
                        f"which is already a shard"
                    ) from None
        path = f"{base}/{name}"
        try:
            handle = self.create_shard_file(path, size_hint)
        except TargetExistsError as exc:
            raise ShardExistsError(f"shard {name!r} already exists in this attempt") from exc
        unsynced = self._unsynced_files(step, attempt)
        return _FileShardSink(self.driver, unsynced, path, f"{DATA_DIR}/{name}", handle)

    def create_shard_file(self, path: str, size_hint: int | None) -> int:
        """Create a shard's file exclusively; subclasses may choose its layout by size."""
        return self.driver.create(path)

    def seal(self, step: int, attempt: str) -> None:
        with self._unsynced_lock:
            files = self._unsynced.pop((step, attempt), None)
        if files is not None:
            files.seal()

    def release(self, step: int, attempt: str) -> None:
        with self._unsynced_lock:
            files = self._unsynced.pop((step, attempt), None)
        if files is not None:
            files.discard()

    def publish(self, manifest: Manifest) -> None:
        self.seal(manifest.step, manifest.attempt)
        staging = self.staging_dir(manifest.step, manifest.attempt)
        handle = self.driver.create(f"{staging}/{MANIFEST_NAME}")
        try:
            self.driver.write(handle, memoryview(manifest.encode()))
            self.driver.fsync(handle)
        finally:
            self.driver.close(handle)
        # Shard files are fsynced; their directory entries are not, until every directory
        # that holds them is fsynced (deepest first, the staging directory last).
        for directory in _directories_of(manifest):
            self.driver.fsync_dir(f"{staging}/{DATA_DIR}/{directory}")
        self.driver.fsync_dir(f"{staging}/{DATA_DIR}")
        self.driver.fsync_dir(staging)
        try:
            self.driver.rename_noreplace(staging, step_token(manifest.step))
        except TargetExistsError as exc:
            raise CheckpointExistsError(
                f"{self.url}: step {manifest.step} is already published; "
                f"the existing checkpoint was left intact"
            ) from exc
        self.driver.fsync_dir("")

    def abort(self, step: int, attempt: str) -> None:
        self.release(step, attempt)
        self._discard(self.staging_dir(step, attempt))

    # -- reading -------------------------------------------------------------------------

    def published_steps(self, min_step: int = 0) -> list[int]:
        try:
            names = self.driver.listdir("")
        except ObjectNotFoundError:
            return []
        steps = (parse_step_token(name) for name in names)
        return sorted(s for s in steps if s is not None and s >= min_step)

    def is_published(self, step: int) -> bool:
        try:
            return self.driver.stat(step_token(step)).is_dir
        except ObjectNotFoundError:
            return False

    def read_manifest(self, step: int) -> Manifest:
        final = step_token(step)
        where = f"{self.url}/{final}/{MANIFEST_NAME}"
        if not self.is_published(step):
            raise CheckpointNotFoundError(f"{self.url}: no published checkpoint at step {step}")
        try:
            with self.driver.open_read(f"{final}/{MANIFEST_NAME}") as stream:
                data = stream.read(MAX_MANIFEST_BYTES + 1)
        except ObjectNotFoundError as exc:
            raise ManifestCorruptError(f"{where}: published checkpoint has no manifest") from exc
        manifest = Manifest.decode(data, where=where, expected_step=step)
        for record in manifest.shards:
            if dict(record.locator) != {"path": f"{DATA_DIR}/{record.name}"}:
                raise ManifestCorruptError(
                    f"{where}: shard {record.name!r} has a foreign locator {record.locator!r}"
                )
        return manifest

    def open_shard_reader(self, manifest: Manifest, record: ShardRecord) -> BinaryIO:
        path = f"{step_token(manifest.step)}/{DATA_DIR}/{record.name}"
        try:
            return self.driver.open_read(path)
        except ObjectNotFoundError as exc:
            raise ShardMissingError(
                f"{self.url}: step {manifest.step}: shard {record.name!r} is missing ({path})"
            ) from exc

    def shard_problems(self, manifest: Manifest) -> list[ShardProblem]:
        problems: list[ShardProblem] = []
        final = step_token(manifest.step)
        for record in manifest.shards:
            try:
                stat = self.driver.stat(f"{final}/{DATA_DIR}/{record.name}")
            except ObjectNotFoundError:
                problems.append(ShardProblem(record.name, missing=True))
                continue
            if stat.is_dir or stat.size != record.size:
                problems.append(ShardProblem(record.name, False, stat.size, record.size))
        return problems

    # -- LATEST hint ---------------------------------------------------------------------

    def read_latest_hint(self) -> int | None:
        try:
            with self.driver.open_read(LATEST_NAME) as stream:
                text = stream.read(64)
        except ObjectNotFoundError:
            return None
        try:
            return int(text.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            log.warning("%s/%s is unreadable (%r); ignoring the hint", self.url, LATEST_NAME, text)
            return None

    def advance_latest_hint(self, step: int) -> None:
        current = self.read_latest_hint()
        if current is None or current < step:
            self._write_latest(step)

    def reset_latest_hint(self, step: int | None) -> None:
        if step is not None:
            self._write_latest(step)
            return
        try:
            self.driver.unlink(LATEST_NAME)
        except ObjectNotFoundError:
            return
        self.driver.fsync_dir("")

    def _write_latest(self, step: int) -> None:
        tmp = f"{LATEST_TMP_PREFIX}{new_attempt_id()}"
        handle = self.driver.create(tmp)
        try:
            self.driver.write(handle, memoryview(f"{step}\n".encode("ascii")))
            self.driver.fsync(handle)
        finally:
            self.driver.close(handle)
        self.driver.rename_replace(tmp, LATEST_NAME)
        self.driver.fsync_dir("")

    # -- removal -------------------------------------------------------------------------

    def unpublish(self, step: int) -> None:
        final = step_token(step)
        trash = f"{TRASH_PREFIX}{final}-{new_attempt_id()}"
        try:
            self.driver.rename_noreplace(final, trash)
        except ObjectNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.url}: no published checkpoint at step {step}"
            ) from exc
        self.driver.fsync_dir("")
        self._remove_tree(trash)

    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> GcReport:
        report = GcReport(dry_run=dry_run, grace_s=grace_s)
        try:
            names = self.driver.listdir("")
        except ObjectNotFoundError:
            return report
        for name in names:
            if name.startswith(TRASH_PREFIX):
                kind, always = "trash", True
            elif PENDING_MARK in name and parse_step_token(name.split(PENDING_MARK)[0]) is not None:
                kind, always = "staging", False
            elif name.startswith(LATEST_TMP_PREFIX):
                kind, always = "pointer-temp", False
            else:
                continue
            try:
                newest, size = self._activity(name)
            except ObjectNotFoundError:
                continue
            item = GcItem(kind=kind, name=name, age_s=max(0.0, now - newest), size=size)
            if not always and item.age_s <= grace_s:
                report.kept_young.append(item)
                continue
            report.removed.append(item)
            if not dry_run:
                self._discard(name)
        return report

    def stored_names(self, manifest: Manifest) -> set[str]:
        final = step_token(manifest.step)
        names = {final, f"{final}/{MANIFEST_NAME}", f"{final}/{DATA_DIR}"}
        for directory in _directories_of(manifest):
            names.add(f"{final}/{DATA_DIR}/{directory}")
        names.update(f"{final}/{DATA_DIR}/{record.name}" for record in manifest.shards)
        return names

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
                path = f"{directory}/{child}" if directory else child
                names.add(path)
                try:
                    if self.driver.stat(path).is_dir:
                        pending.append(path)
                except ObjectNotFoundError:
                    continue
        return names

    def is_empty(self) -> bool:
        try:
            return not self.driver.listdir("")
        except ObjectNotFoundError:
            return True

    def _activity(self, path: str) -> tuple[float, int]:
        """Return the newest mtime anywhere under ``path`` and the total size of its files."""
        stat = self.driver.stat(path)
        if not stat.is_dir:
            return stat.mtime, stat.size
        newest, size = stat.mtime, 0
        for child in self.driver.listdir(path):
            try:
                child_newest, child_size = self._activity(f"{path}/{child}")
            except ObjectNotFoundError:
                continue
            newest, size = max(newest, child_newest), size + child_size
        return newest, size

    def _discard(self, path: str) -> None:
        """Rename ``path`` to a trash name (so no one can publish or reuse it), then delete it."""
        if path.startswith(TRASH_PREFIX):
            trash = path
        else:
            trash = f"{TRASH_PREFIX}{path.lstrip('.')}-{new_attempt_id()}"
            try:
                self.driver.rename_noreplace(path, trash)
            except ObjectNotFoundError:
                return
        self._remove_tree(trash)

    def _remove_tree(self, path: str) -> None:
        try:
            stat = self.driver.stat(path)
            if not stat.is_dir:
                self.driver.unlink(path)
                return
            for child in self.driver.listdir(path):
                self._remove_tree(f"{path}/{child}")
            self.driver.rmdir(path)
        except ObjectNotFoundError:
            return  # removed concurrently by another cleaner


def _directories_of(manifest: Manifest) -> list[str]:
    """Every directory below ``data/`` that holds a shard, deepest first."""
    directories: set[str] = set()
    for record in manifest.shards:
        segments = record.name.split("/")
        for depth in range(1, len(segments)):
            directories.add("/".join(segments[:depth]))
    return sorted(directories, key=lambda d: (-d.count("/"), d))
