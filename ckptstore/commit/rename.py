"""Publish by renaming a fully fsynced staging directory onto a step name that must not exist.

Layout under the store's root directory (docs/protocol.md §3)::

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
seal (before the manifest, or before a rank sends its receipts) fsyncs them all. How many
files wait so is bounded per attempt and by the process's descriptor limit (``unsynced.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import BinaryIO, TypeVar

from ckptstore import names
from ckptstore.commit.base import (
    CommitStrategy,
    FileId,
    GcItem,
    GcReport,
    ShardProblem,
    ShardSink,
    clock_lead,
)
from ckptstore.commit.blob_area import BLOB_AREA, FileBlobArea
from ckptstore.commit.unsynced import UnsyncedFiles
from ckptstore.driver import Capability, FileSystemDriver, LinkingDriver
from ckptstore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    EpochExistsError,
    IntegrityError,
    InvalidShardNameError,
    ManifestCorruptError,
    NotACheckpointError,
    ObjectNotFoundError,
    ShardCorruptError,
    ShardExistsError,
    ShardMissingError,
    StorageAccessDeniedError,
    StorageError,
    StrayEntryError,
    TargetExistsError,
)
from ckptstore.hint import MAX_HINT_BYTES, encode_hint, ignore_hint, parse_hint
from ckptstore.manifest import MAX_MANIFEST_BYTES, Manifest, ShardRecord
from ckptstore.shardbytes import ShardBytes

__all__ = ["FileShardSink", "RenameCommit", "directories_of"]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
LATEST_NAME = "LATEST"
PENDING_MARK = ".pending-"
TRASH_PREFIX = ".trash-"
LATEST_TMP_PREFIX = ".LATEST.tmp-"
GC_CLOCK_PREFIX = ".gc-clock-"
EPOCHS_DIR = "epochs"
EPOCH_RECORD = "record.json"
# A path component that is a file (ENOTDIR), a manifest that is a directory (EISDIR), a FIFO or
# device planted as one (ENXIO, or EFTYPE/EINVAL from a regular-files-only open).
_WRONG_KIND_ERRNOS = frozenset(
    {errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.EINVAL, getattr(errno, "EFTYPE", errno.EINVAL)}
)
_RenameT = TypeVar("_RenameT", bound="RenameCommit")


class FileShardSink(ShardSink):
    """Streams one shard into a new file of its attempt; at close, the file joins the
    attempt's held files (``UnsyncedFiles``), to be fsynced at seal.

    ``errors`` wraps each driver call (translating, say, a vanished attempt directory into
    GC's explanation); a strategy over another file system reuses this sink as it is.
    """

    def __init__(
        self,
        driver: FileSystemDriver,
        unsynced: UnsyncedFiles,
        path: str,
        locator: str,
        handle: int,
        errors: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self._driver = driver
        self._unsynced = unsynced
        self._path = path
        self._locator = locator
        self._handle: int | None = handle
        self._errors = errors

    def write(self, data: memoryview) -> None:
        assert self._handle is not None
        with self._errors():
            self._driver.write(self._handle, data)

    def clone_from(self, source: int) -> BinaryIO | None:
        clone = getattr(self._driver, "clone", None)  # optional: a driver that clones
        if clone is None or self._handle is None:
            return None
        with self._errors():
            if not clone(self._handle, source):
                return None
            return self._driver.open_read(self._path)

    def close(self) -> Mapping[str, str]:
        assert self._handle is not None
        handle, self._handle = self._handle, None
        with self._errors():
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
    keeps_lineages = True
    fixed_names = frozenset({LATEST_NAME})

    def __init__(self, driver: FileSystemDriver) -> None:
        super().__init__(driver)
        self._unsynced: dict[tuple[int, str], UnsyncedFiles] = {}
        self._unsynced_lock = threading.Lock()
        self._blobs = FileBlobArea(driver) if isinstance(driver, LinkingDriver) else None

    def open_root(self, *, create: bool) -> None:
        self.driver.ensure_root(create)

    def _unsynced_files(self, step: int, attempt: str) -> UnsyncedFiles:
        with self._unsynced_lock:
            files = self._unsynced.get((step, attempt))
            if files is None:
                files = self._unsynced[step, attempt] = UnsyncedFiles(self.driver)
            return files

    # -- writing -------------------------------------------------------------------------

    @staticmethod
    def staging_dir(step: int, attempt: str) -> str:
        """The staging directory's name for an attempt."""
        return f"{names.step_token(step)}{PENDING_MARK}{attempt}"

    def begin(self, step: int, attempt: str) -> None:
        staging = self.staging_dir(step, attempt)
        self.driver.mkdir(staging)
        self.driver.mkdir(f"{staging}/{DATA_DIR}")

    def open_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None = None
    ) -> ShardSink:
        with self._attempt_errors(step, attempt):
            path, handle = self._create_shard(step, attempt, name, size_hint)
        unsynced = self._unsynced_files(step, attempt)
        errors = lambda: self._attempt_errors(step, attempt)  # noqa: E731
        return FileShardSink(self.driver, unsynced, path, f"{DATA_DIR}/{name}", handle, errors)

    @property
    def shares_shards(self) -> bool:
        return self._blobs is not None

    def share_shard(
        self,
        step: int,
        attempt: str,
        name: str,
        crc32c: str,
        size: int,
        data: ShardBytes,
        digest: str | None = None,
    ) -> Mapping[str, str] | None:
        """A hard link, in the staging directory, to a sealed shard file holding exactly
        ``data`` (§12.2): durable with the staging directory's fsyncs."""
        if self._blobs is None:
            return None
        with self._attempt_errors(step, attempt):
            path = self._shard_path(step, attempt, name)
            try:
                shared = self._blobs.share(crc32c, size, path, data)
            except TargetExistsError as exc:
                raise ShardExistsError(
                    f"shard {name!r} already exists in this attempt", key=name
                ) from exc
        return {"path": f"{DATA_DIR}/{name}"} if shared else None

    def saved_incrementally(self) -> bool:
        if self._blobs is None:
            return False
        try:
            return self.driver.stat(BLOB_AREA).is_dir
        except StorageError:
            return False

    def shard_files(self, manifest: Manifest) -> dict[str, FileId]:
        if not isinstance(self.driver, LinkingDriver):
            return {}
        final = names.checkpoint_token(manifest.step, manifest.epoch)
        found: dict[str, FileId] = {}
        for record in manifest.shards:
            try:
                found[record.name] = self.driver.links(f"{final}/{DATA_DIR}/{record.name}").file_id
            except StorageError:
                continue  # gone or not a file: verify says so, not this
        return found

    def index_shards(self, step: int, attempt: str, shards: Mapping[str, tuple[str, int]]) -> None:
        """Link each sealed shard file of the attempt's staging directory into the blob
        area: the file this save wrote and fsynced, whatever happens to the step's name
        later (a published step deleted and saved again by another writer)."""
        if self._blobs is None:
            return
        staging = f"{self.staging_dir(step, attempt)}/{DATA_DIR}"
        for name, (crc32c, size) in shards.items():
            self._blobs.index(crc32c, size, f"{staging}/{name}")

    def _create_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None
    ) -> tuple[str, int]:
        path = self._shard_path(step, attempt, name)
        try:
            return path, self.create_shard_file(path, size_hint)
        except TargetExistsError as exc:
            raise ShardExistsError(
                f"shard {name!r} already exists in this attempt", key=name
            ) from exc

    def _shard_path(self, step: int, attempt: str, name: str) -> str:
        """The path of shard ``name`` in the attempt's staging directory, its parent
        directories made."""
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
                        f"which is already a shard",
                        key=name,
                    ) from None
        return f"{base}/{name}"

    def create_shard_file(self, path: str, size_hint: int | None) -> int:
        """Create a shard's file exclusively; subclasses may choose its layout by size."""
        return self.driver.create(path)

    def seal(self, step: int, attempt: str) -> None:
        with self._attempt_errors(step, attempt):
            self._seal_files(step, attempt)

    def _seal_files(self, step: int, attempt: str) -> None:
        with self._unsynced_lock:
            files = self._unsynced.pop((step, attempt), None)
        if files is not None:
            files.seal()

    def release(self, step: int, attempt: str) -> None:
        """Let go of the attempt's held files in this process: each is fsynced and closed.

        Not discarded: other ranks in this process that joined the same attempt may still seal
        and publish them. The entry stays, so a failed fsync here fails their seal too.
        """
        with self._unsynced_lock:
            files = self._unsynced.get((step, attempt))
        if files is not None:
            files.seal()

    def _discard_held(self, step: int, attempt: str) -> None:
        with self._unsynced_lock:
            files = self._unsynced.pop((step, attempt), None)
        if files is not None:
            files.discard()

    def publish(self, manifest: Manifest) -> None:
        step, attempt = manifest.step, manifest.attempt
        staging = self.staging_dir(step, attempt)
        try:
            with self._attempt_errors(step, attempt):
                self._seal_files(step, attempt)
                self._write_manifest(staging, manifest)
        except Exception:
            # Before the rename the outcome is certain: nothing is published, and no other
            # process publishes this attempt. Its staging data goes now (ENOSPC while writing
            # the manifest, a failed fsync), not after gc's grace period.
            self.discard(step, attempt)
            raise
        try:
            with self._attempt_errors(step, attempt):
                try:
                    self.driver.rename_noreplace(
                        staging, names.checkpoint_token(step, manifest.epoch)
                    )
                except TargetExistsError as exc:
                    raise self.name_taken(step, manifest.epoch) from exc
        except ObjectNotFoundError:
            # A rename that took effect but answered an error (an NFS retransmit's ENOENT)
            # leaves no staging directory either: it published, GC did not remove it.
            if self._published_attempt(step, manifest.epoch) != attempt:
                raise
        self.driver.fsync_dir("")

    def name_taken(self, step: int, epoch: int = 0) -> CheckpointExistsError | StrayEntryError:
        """What holds the name a publishing rename needs: a published checkpoint, or a stray
        (a directory without a manifest, a file, a manifest that does not parse), which no
        save could ever publish beside, so it is named for the operator to remove."""
        final = names.checkpoint_token(step, epoch)
        try:
            self.read_manifest(step, epoch)
        except NotACheckpointError:
            return StrayEntryError.in_the_way(f"{self.url}/{final}", step, "it has no manifest")
        except ManifestCorruptError as exc:
            return StrayEntryError.in_the_way(
                f"{self.url}/{final}", step, f"its manifest does not read back: {exc}"
            )
        except (CheckpointNotFoundError, IntegrityError, StorageError):
            pass  # unpublished since, or unreadable now: it was a checkpoint, or may be one
        return CheckpointExistsError(
            f"{self.url}: step {step} is already published; the existing checkpoint was left "
            f"intact",
            url=self.url,
            step=step,
        )

    def _published_attempt(self, step: int, epoch: int) -> str | None:
        try:
            return self.read_manifest(step, epoch).attempt
        except (CheckpointNotFoundError, IntegrityError, StorageError):
            return None

    def _write_manifest(self, staging: str, manifest: Manifest) -> None:
        """Write and fsync the manifest, then make every entry of the staging tree durable."""
        handle = self.driver.create(f"{staging}/{MANIFEST_NAME}")
        try:
            self.driver.write(handle, memoryview(manifest.encode()))
            self.driver.fsync(handle)
        finally:
            self.driver.close(handle)
        # Shard files are fsynced; their directory entries are not, until every directory
        # that holds them is fsynced (deepest first, the staging directory last).
        for directory in directories_of(manifest):
            self.driver.fsync_dir(f"{staging}/{DATA_DIR}/{directory}")
        self.driver.fsync_dir(f"{staging}/{DATA_DIR}")
        self.driver.fsync_dir(staging)

    @contextlib.contextmanager
    def _attempt_errors(self, step: int, attempt: str) -> Iterator[None]:
        """Report a failure of an attempt whose staging directory is gone as what it is.

        GC removes an attempt idle for longer than its grace period. Its writer, if alive
        after all, then fails at its next shard open, write or fsync, its seal, its manifest
        or its publishing rename with ENOENT (or ESTALE), which alone would not say why.
        """
        try:
            yield
        except StorageError as exc:
            if self._staging_exists(step, attempt):
                raise
            if not self._exists(""):  # GC never removes the root: someone else did
                raise ObjectNotFoundError(
                    errno.ENOENT,
                    f"{self.url}: the store's root directory is gone (removed, renamed or "
                    f"unmounted) while attempt {attempt} of step {step} was being saved; nothing "
                    f"was published. Check the path, then save again ({exc})",
                    url=self.url,
                    step=step,
                ) from exc
            raise ObjectNotFoundError(
                errno.ENOENT,
                f"{self.url}: attempt {attempt} of step {step} was removed by garbage "
                f"collection (its staging directory {self.staging_dir(step, attempt)} is "
                f"gone); the grace period must exceed the longest time a live save goes "
                f"without writing. Nothing of this attempt was published ({exc})",
                url=self.url,
                step=step,
            ) from exc

    def _staging_exists(self, step: int, attempt: str) -> bool:
        try:
            self.driver.stat(self.staging_dir(step, attempt))
        except ObjectNotFoundError:
            return False
        except StorageError:
            return True  # unknown: the original error stands
        return True

    def abort(self, step: int, attempt: str) -> None:
        self._discard_held(step, attempt)  # the whole attempt goes: nothing to make durable
        self._discard(self.staging_dir(step, attempt))

    # -- reading -------------------------------------------------------------------------

    def published_steps(self, min_step: int = 0) -> list[int]:
        return [step for step, epoch in self.published_checkpoints(min_step) if epoch == 0]

    def published_checkpoints(self, min_step: int = 0) -> list[tuple[int, int]]:
        try:
            entries = self.driver.listdir("")
        except ObjectNotFoundError:
            return []
        found = (names.parse_checkpoint_token(name) for name in entries)
        return sorted(entry for entry in found if entry is not None and entry[0] >= min_step)

    def is_published(self, step: int, epoch: int = 0) -> bool:
        try:
            return self.driver.stat(names.checkpoint_token(step, epoch)).is_dir
        except ObjectNotFoundError:
            return False

    def read_manifest(self, step: int, epoch: int = 0) -> Manifest:
        final = names.checkpoint_token(step, epoch)
        where = f"{self.url}/{final}/{MANIFEST_NAME}"
        try:
            with self.driver.open_read(f"{final}/{MANIFEST_NAME}") as stream:
                data = stream.read(MAX_MANIFEST_BYTES + 1)
        except ObjectNotFoundError as exc:
            raise self._no_manifest(step, epoch) from exc
        except StorageError as exc:
            if exc.errno not in _WRONG_KIND_ERRNOS:
                raise
            # `step-N` is a file (ENOTDIR), or its manifest is a directory or a FIFO.
            if not self.is_published(step, epoch):
                raise self._no_manifest(step, epoch) from exc
            raise ManifestCorruptError(f"{where}: {exc.strerror}") from exc
        manifest = Manifest.decode(data, where=where, expected_step=step, expected_epoch=epoch)
        for record in manifest.shards:
            if dict(record.locator) != {"path": f"{DATA_DIR}/{record.name}"}:
                raise ManifestCorruptError(
                    f"{where}: shard {record.name!r} has a foreign locator {record.locator!r}",
                    key=record.name,
                )
        return manifest

    def _exists(self, path: str) -> bool:
        try:
            self.driver.stat(path)
        except ObjectNotFoundError:
            return False
        return True

    def _no_manifest(self, step: int, epoch: int = 0) -> CheckpointNotFoundError:
        """The error for a step without a manifest: unpublished meanwhile, or never published.

        A published directory always holds its manifest (it is written before the publishing
        rename), so a directory without one is a stray (an operator's mkdir, a partial copy),
        not a damaged checkpoint; and one that has just gone was unpublished by a racing
        delete or retention, which is not damage either.
        """
        final = names.checkpoint_token(step, epoch)
        if self._exists(final):
            return NotACheckpointError(
                f"{self.url}/{final} is not a checkpoint: it has no manifest "
                f"(a stray entry; ckptstore leaves it alone)",
                url=self.url,
            )
        return CheckpointNotFoundError(
            f"{self.url}: no published checkpoint at step {step}", url=self.url, step=step
        )

    def open_shard_reader(self, manifest: Manifest, record: ShardRecord) -> BinaryIO:
        path = f"{names.checkpoint_token(manifest.step, manifest.epoch)}/{DATA_DIR}/{record.name}"
        try:
            return self.driver.open_read(path)
        except ObjectNotFoundError as exc:
            missing = f"is missing ({path})"
            raise self.shard_error(ShardMissingError, manifest, record, missing) from exc
        except StorageError as exc:
            if exc.errno not in _WRONG_KIND_ERRNOS:
                raise
            problem = f"is not a regular file ({path}: {exc.strerror})"
            # a directory, FIFO or symlink planted as the shard
            raise self.shard_error(ShardCorruptError, manifest, record, problem) from exc

    def shard_problems(self, manifest: Manifest) -> list[ShardProblem]:
        problems: list[ShardProblem] = []
        final = names.checkpoint_token(manifest.step, manifest.epoch)
        for record in manifest.shards:
            try:
                stat = self.driver.stat(f"{final}/{DATA_DIR}/{record.name}")
            except ObjectNotFoundError:
                problems.append(ShardProblem(record.name, missing=True))
                continue
            if stat.is_dir or stat.size != record.size:
                problems.append(ShardProblem(record.name, False, stat.size, record.size))
        return problems

    # -- lineages (docs/protocol.md §8.1) ------------------------------------------------

    def create_epoch(self, epoch: int, record: bytes) -> None:
        """Stage ``epochs/epoch-<E>.pending-<id>/record.json``, make it durable, then rename
        it to ``epochs/epoch-<E>`` without replacing: the record exists whole or not at all,
        and only once (a directory that holds a file is never replaced, even by a plain
        rename where the kernel lacks RENAME_NOREPLACE)."""
        final = f"{EPOCHS_DIR}/{names.epoch_token(epoch)}"
        staging = f"{final}{PENDING_MARK}{names.new_attempt_id()}"
        with contextlib.suppress(TargetExistsError):
            self.driver.mkdir(EPOCHS_DIR)
        self.driver.fsync_dir("")  # durable even where another process made it, unsynced yet
        self.driver.mkdir(staging)
        try:
            handle = self.driver.create(f"{staging}/{EPOCH_RECORD}")
            try:
                self.driver.write(handle, memoryview(record))
                self.driver.fsync(handle)
            finally:
                self.driver.close(handle)
            self.driver.fsync_dir(staging)
            try:
                self.driver.rename_noreplace(staging, final)
            except TargetExistsError as exc:
                raise EpochExistsError(
                    f"{self.url}: epoch {epoch} exists already", url=self.url
                ) from exc
        except BaseException:
            self._remove_epoch_staging(staging)
            raise
        self.driver.fsync_dir(EPOCHS_DIR)

    def _remove_epoch_staging(self, staging: str) -> None:
        try:
            self.remove_tree(staging)
        except StorageError as exc:  # a later gc removes it once it is older than its grace
            log.debug("%s: could not remove %s: %s", self.url, staging, exc)

    def read_epoch(self, epoch: int) -> bytes | None:
        path = f"{EPOCHS_DIR}/{names.epoch_token(epoch)}/{EPOCH_RECORD}"
        try:
            with self.driver.open_read(path) as stream:
                return stream.read(MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            if not self._exists(f"{EPOCHS_DIR}/{names.epoch_token(epoch)}"):
                return None
            try:  # read again: a taker may have renamed its record in since the first read
                with self.driver.open_read(path) as stream:
                    return stream.read(MAX_MANIFEST_BYTES)
            except ObjectNotFoundError:
                return b""  # a record directory without its record: damage, not absence
        except StorageError as exc:
            if exc.errno not in _WRONG_KIND_ERRNOS:
                raise
            return b""  # a directory or FIFO planted as the record: damage

    def listed_epochs(self) -> list[int]:
        try:
            entries = self.driver.listdir(EPOCHS_DIR)
        except ObjectNotFoundError:
            return []
        except StorageError as exc:
            if exc.errno not in _WRONG_KIND_ERRNOS:
                raise
            return []  # a file named "epochs": readers probe past the listing anyway
        found = (names.parse_epoch_token(name) for name in entries)
        return sorted(epoch for epoch in found if epoch is not None)

    # -- LATEST hint ---------------------------------------------------------------------

    def read_latest_hint(self) -> int | None:
        where = f"{self.url}/{LATEST_NAME}"
        try:
            with self.driver.open_read(LATEST_NAME) as stream:
                text = stream.read(MAX_HINT_BYTES)
        except ObjectNotFoundError:
            return None
        except StorageError as exc:  # a directory or FIFO named LATEST, an unreadable file
            ignore_hint(where, str(exc))
            return None
        return parse_hint(text, where=where)

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
        tmp = f"{LATEST_TMP_PREFIX}{names.new_attempt_id()}"
        handle = self.driver.create(tmp)
        try:
            self.driver.write(handle, memoryview(encode_hint(step)))
            self.driver.fsync(handle)
        finally:
            self.driver.close(handle)
        try:
            self.driver.rename_replace(tmp, LATEST_NAME)
        except StorageError:
            # LATEST is a directory, say: leave no temporary pointer behind for GC.
            self.remove_tree(tmp)
            raise
        self.driver.fsync_dir("")

    # -- removal -------------------------------------------------------------------------

    def unpublish(self, step: int, epoch: int = 0) -> None:
        final = names.checkpoint_token(step, epoch)
        trash = f"{TRASH_PREFIX}{final}-{names.new_attempt_id()}"
        try:
            self.driver.rename_noreplace(final, trash)
        except ObjectNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.url}: no published checkpoint at step {step}", url=self.url, step=step
            ) from exc
        self.driver.fsync_dir("")
        self.remove_tree(trash)

    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> GcReport:
        """Remove trash, and staging and temporary files idle for longer than ``grace_s``,
        and the entries of the blob area no checkpoint links any more (§12.2).

        Idle time is measured on the file system's clock, not this host's: GC first creates a
        file ``.gc-clock-<id>`` in the store's root (removed at the end) and compares each
        leftover's newest mtime with that file's. Any skew between this host's clock and the
        file system's is tolerated. What remains: on a file system that stamps files with the
        writing client's clock (Lustre) rather than one server's, a writer whose clock runs
        behind this host's by d looks d idler, so the grace period must exceed the longest
        pause of a live save plus d. Where the file cannot be created (a read-only store,
        where nothing can be removed either), ``now`` is used.
        """
        report = GcReport(dry_run=dry_run, grace_s=grace_s)
        try:
            clock_file, fs_now = self._file_system_now(now)
        except ObjectNotFoundError:
            return report  # no store directory
        try:
            entries = self.driver.listdir("")
            lead = clock_lead(now) if clock_file is not None else 0.0
            for name in entries:
                if name != clock_file:
                    self._collect(name, fs_now + lead, report)
            if EPOCHS_DIR in entries:
                self._collect_epoch_staging(fs_now + lead, report)
            if BLOB_AREA in entries and self._blobs is not None:
                self._blobs.sweep(fs_now + lead, report)
        except ObjectNotFoundError:
            return report
        finally:
            if clock_file is not None:
                self._remove_quietly(clock_file)
        return report

    def _collect(self, name: str, now: float, report: GcReport) -> None:
        """Remove one root entry if the protocol made it and it is idle for longer than the
        grace period (trash at any age)."""
        kind_always = _garbage_kind(name)
        if kind_always is None:
            return  # not made by the protocol: a stray is left alone
        kind, always = kind_always
        try:
            newest, size = self._activity(name)
        except ObjectNotFoundError:
            return
        idle = now - newest  # negative: changed after this gc started
        item = GcItem(kind=kind, name=name, age_s=max(0.0, idle), size=size)
        if not always and idle < report.grace_s:
            if kind != "gc-clock":  # another gc's, in use: not worth a line of the report
                report.kept_young.append(item)
            return
        report.removed.append(item)
        if not report.dry_run:
            self._discard(name)

    def _collect_epoch_staging(self, now: float, report: GcReport) -> None:
        """Remove the staging of epoch records whose taker died (idle past the grace period),
        renamed to a trash name first so that a taker only stalled cannot publish it half
        removed; never a record."""
        try:
            entries = self.driver.listdir(EPOCHS_DIR)
        except StorageError:
            return
        for name in entries:
            path = f"{EPOCHS_DIR}/{name}"
            token, found, attempt = name.partition(PENDING_MARK)
            trash = name.startswith(TRASH_PREFIX) and check_attempt_name_tail(name)
            staging = bool(found) and names.parse_epoch_token(token) is not None
            if not trash and not (staging and check_attempt_name_tail(f"-{attempt}")):
                continue
            try:
                newest, size = self._activity(path)
            except ObjectNotFoundError:
                continue
            item = GcItem("epoch-staging", path, max(0.0, now - newest), size)
            if not trash and now - newest < report.grace_s:
                report.kept_young.append(item)
                continue
            report.removed.append(item)
            if report.dry_run:
                continue
            if not trash:
                doomed = f"{EPOCHS_DIR}/{TRASH_PREFIX}{name}-{names.new_attempt_id()}"
                try:
                    self.driver.rename_noreplace(path, doomed)
                except ObjectNotFoundError:
                    continue
                path = doomed
            self.remove_tree(path)

    def _file_system_now(self, now: float) -> tuple[str | None, float]:
        """Create a file to read the file system's clock: its name and its mtime.

        ``(None, now)`` where no file can be created in the store's root.
        """
        name = f"{GC_CLOCK_PREFIX}{names.new_attempt_id()}"
        try:
            self.driver.close(self.driver.create(name))
        except StorageError as exc:
            if not isinstance(exc, StorageAccessDeniedError) and exc.errno != errno.EROFS:
                raise
            log.info("%s: gc ages leftovers by this host's clock (%s)", self.url, exc)
            return None, now
        try:
            return name, self.driver.stat(name).mtime
        except BaseException:
            self._remove_quietly(name)
            raise

    def _remove_quietly(self, name: str) -> None:
        try:
            self.driver.unlink(name)
        except StorageError as exc:  # a later gc removes it once it is older than its grace
            log.debug("%s: could not remove %s: %s", self.url, name, exc)

    def is_empty(self) -> bool:
        try:
            entries = self.driver.listdir("")
        except ObjectNotFoundError:
            return True
        return all(name.startswith(GC_CLOCK_PREFIX) for name in entries)  # a running gc's

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
            trash = f"{TRASH_PREFIX}{path.lstrip('.')}-{names.new_attempt_id()}"
            try:
                self.driver.rename_noreplace(path, trash)
            except ObjectNotFoundError:
                return
        self.remove_tree(trash)

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; what vanishes meanwhile is no error."""
        try:
            stat = self.driver.stat(path)
            if not stat.is_dir:
                self.driver.unlink(path)
                return
            for child in self.driver.listdir(path):
                self.remove_tree(f"{path}/{child}")
            self.driver.rmdir(path)
        except ObjectNotFoundError:
            return  # removed concurrently by another cleaner


def _garbage_kind(name: str) -> tuple[str, bool] | None:
    """What the protocol made a root entry ``name`` for, and whether GC removes it at any age.

    Names are matched exactly (a fresh attempt id at the end of each), so an operator's
    ``.trash-mine`` or ``step-...pending-copy`` is not taken for the protocol's own.
    """
    if name.startswith(TRASH_PREFIX) and check_attempt_name_tail(name):
        return "trash", True
    if names.parse_attempt_name(name, PENDING_MARK) is not None:
        return "staging", False
    if name.startswith(LATEST_TMP_PREFIX) and check_attempt_name_tail(name):
        return "pointer-temp", False
    if name.startswith(GC_CLOCK_PREFIX) and check_attempt_name_tail(name):
        return "gc-clock", False  # left by a gc that died
    return None


def check_attempt_name_tail(name: str) -> bool:
    """True if ``name`` ends with ``-`` and an attempt id, as every trash and temporary does."""
    _, dash, tail = name.rpartition("-")
    try:
        return bool(dash) and names.check_attempt_id(tail) == tail
    except InvalidShardNameError:
        return False


def directories_of(manifest: Manifest) -> list[str]:
    """Every directory below ``data/`` that holds a shard, deepest first."""
    directories: set[str] = set()
    for record in manifest.shards:
        segments = record.name.split("/")
        for depth in range(1, len(segments)):
            directories.add("/".join(segments[:depth]))
    return sorted(directories, key=lambda d: (-d.count("/"), d))
