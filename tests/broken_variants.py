"""Deliberately broken drivers, commit strategies and readers, each a model of how a real
checkpointing system or storage server failed; the conformance suite must catch every one.

Each variant subclasses a real driver or strategy and changes only the broken part, so that
what the suite sees is the real protocol with one real-world mistake in it. Their tests are in
``test_conformance_variants.py`` and ``test_conformance_blame.py``; docs/conformance.md's table
lists every one (a test checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, BinaryIO

from ckptstore.backends.memory import MemoryDriver, _Version
from ckptstore.backends.posix import PosixDriver
from ckptstore.checkpoint import Checkpoint, VerifyReport
from ckptstore.commit.base import CommitStrategy, GcItem, GcReport
from ckptstore.commit.blob_leases import BlobLeases, BlobName, User
from ckptstore.commit.conditional_put import MANIFESTS, ConditionalPutCommit
from ckptstore.commit.rename import (
    DATA_DIR,
    LATEST_NAME,
    MANIFEST_NAME,
    FileShardSink,
    RenameCommit,
    directories_of,
)
from ckptstore.conformance.audit import audit_of
from ckptstore.driver import Buffer, ObjectInfo, PartInfo, PutMode, UploadInfo, UploadProgress
from ckptstore.errors import (
    CheckpointExistsError,
    ObjectNotFoundError,
    PreconditionFailedError,
    TargetExistsError,
    TransientStorageError,
)
from ckptstore.hint import encode_hint
from ckptstore.lineage import Lineage
from ckptstore.manifest import Manifest
from ckptstore.names import checkpoint_token, parse_step_token, step_token
from ckptstore.retention import CheckpointAge
from ckptstore.shardbytes import ShardBytes
from ckptstore.store import Store
from ckptstore.tiers.replication import Replicator

# -- file systems: torch DCP, gcsfuse, Megatron, Lightning ---------------------------------


class DcpInPlaceCommit(RenameCommit):
    """torch DCP's ``FileSystemWriter``: shard files are opened ``"wb"`` straight in the
    checkpoint directory; ``finish`` writes ``.metadata.tmp``, removes an existing
    ``.metadata`` ("in case other checkpoints were present") and renames over it. Two saves of
    one checkpoint id both "succeed", the second overwriting the first's files."""

    keeps_lineages = False  # writes in place: no room for an epoch's name
    create_epoch = CommitStrategy.create_epoch

    @staticmethod
    def staging_dir(step: int, attempt: str) -> str:
        return step_token(step)

    def begin(self, step: int, attempt: str) -> None:
        for path in (step_token(step), f"{step_token(step)}/{DATA_DIR}"):
            try:
                self.driver.mkdir(path)
            except TargetExistsError:
                pass  # os.makedirs(exist_ok=True)

    def create_shard_file(self, path: str, size_hint: int | None) -> int:
        try:
            self.driver.unlink(path)  # open(path, "wb") truncates another save's file
        except ObjectNotFoundError:
            pass
        return self.driver.create(path)

    def is_published(self, step: int, epoch: int = 0) -> bool:
        try:
            self.driver.stat(f"{step_token(step)}/{MANIFEST_NAME}")
        except ObjectNotFoundError:
            return False
        return True

    def publish(self, manifest: Manifest) -> None:
        final = step_token(manifest.step)
        self._seal_files(manifest.step, manifest.attempt)
        tmp = f"{final}/{MANIFEST_NAME}.tmp"
        handle = self.create_shard_file(tmp, None)
        self.driver.write(handle, memoryview(manifest.encode()))
        self.driver.fsync(handle)
        self.driver.close(handle)
        try:
            self.driver.unlink(f"{final}/{MANIFEST_NAME}")
        except ObjectNotFoundError:
            pass
        self.driver.rename_replace(tmp, f"{final}/{MANIFEST_NAME}")


class UnsyncedManifestCommit(RenameCommit):
    """torch DCP with ``sync_files=False`` (and ``torch.save`` of a Megatron or Lightning
    checkpoint): the metadata file is written and renamed into place, never fsynced. The
    directory entries are durable; the bytes they name may not be."""

    def _write_manifest(self, staging: str, manifest: Manifest) -> None:
        handle = self.driver.create(f"{staging}/{MANIFEST_NAME}")
        try:
            self.driver.write(handle, memoryview(manifest.encode()))
        finally:
            self.driver.close(handle)
        for directory in directories_of(manifest):
            self.driver.fsync_dir(f"{staging}/{DATA_DIR}/{directory}")
        self.driver.fsync_dir(f"{staging}/{DATA_DIR}")
        self.driver.fsync_dir(staging)


class UnsyncedCloneCommit(RenameCommit):
    """A reflinked file committed without its fsync: ``cp --reflink`` (coreutils never fsyncs)
    or a save hook's own ``FICLONE`` (``ioctl_ficlone``), then the commit. The written shards
    are fsynced at the seal; a shard that is a clone is closed at once, its shared extents and
    its size still in the file system's journal, not on disk, when the manifest is."""

    def open_shard(self, step: int, attempt: str, name: str, size_hint: Any = None) -> Any:
        sink = super().open_shard(step, attempt, name, size_hint)
        sink.__class__ = _CloneClosingSink
        return sink


class _CloneClosingSink(FileShardSink):
    """A shard file closed without an fsync once it is a clone (``UnsyncedCloneCommit``)."""

    cloned = False

    def clone_from(self, source: int) -> BinaryIO | None:
        stream = super().clone_from(source)
        self.cloned = stream is not None
        return stream

    def close(self) -> Mapping[str, str]:
        if not self.cloned:
            return super().close()
        handle, self._handle = self._handle, None
        assert handle is not None
        self._driver.close(handle)
        return {"path": self._locator}


class CopyingRenameCommit(RenameCommit):
    """gcsfuse and s3fs-fuse: renaming a directory copies it object by object, then deletes the
    source. Not atomic: a parallel copy finishes the small files (the manifest among them)
    before the large shards, so a crash leaves a checkpoint that looks published but is not
    all there (orbax's ``AtomicRenameTemporaryPath`` on such a mount)."""

    def publish(self, manifest: Manifest) -> None:
        step, attempt = manifest.step, manifest.attempt
        staging, final = self.staging_dir(step, attempt), step_token(step)
        self._seal_files(step, attempt)
        self._write_manifest(staging, manifest)
        if self.is_published(step):
            raise CheckpointExistsError(f"{self.url}: step {step} is already published")
        files: list[tuple[int, str]] = []
        for path in self._tree(staging):
            stat = self.driver.stat(f"{staging}/{path}")
            if stat.is_dir:
                self.driver.mkdir(f"{final}/{path}") if path else self.driver.mkdir(final)
            else:
                files.append((stat.size, path))
        for _size, path in sorted(files):  # what a parallel copy finishes first
            with self.driver.open_read(f"{staging}/{path}") as stream:
                data = stream.read()
            handle = self.driver.create(f"{final}/{path}")
            self.driver.write(handle, data)
            self.driver.close(handle)
        self.remove_tree(staging)

    def _tree(self, root: str, path: str = "") -> Iterator[str]:
        yield path
        where = f"{root}/{path}" if path else root
        for child in self.driver.listdir(where):
            child_path = f"{path}/{child}" if path else child
            if self.driver.stat(f"{root}/{child_path}").is_dir:
                yield from self._tree(root, child_path)
            else:
                yield child_path


class OrbaxTmpDirCommit(RenameCommit):
    """orbax's ``AtomicRenameTemporaryPath``: every save of a step stages in the same
    directory, ``<step>.orbax-checkpoint-tmp``, and removes one it finds there ("not
    finalized"), whoever is writing it. No one else knows the name: the protocol's GC leaves a
    crashed save's directory forever, and a second writer wipes a live one's."""

    TMP_SUFFIX = ".orbax-checkpoint-tmp"

    @staticmethod
    def staging_dir(step: int, attempt: str) -> str:
        return f"{step_token(step)}{OrbaxTmpDirCommit.TMP_SUFFIX}"

    def begin(self, step: int, attempt: str) -> None:
        self.remove_tree(self.staging_dir(step, attempt))
        super().begin(step, attempt)


class InPlaceTrackerCommit(RenameCommit):
    """Megatron's ``latest_checkpointed_iteration.txt``: opened ``"w"`` and written in place,
    neither through a temporary file nor fsynced; a crash in between leaves it empty."""

    def _write_latest(self, step: int) -> None:
        try:
            self.driver.unlink(LATEST_NAME)  # open(tracker, "w") truncates it first
        except ObjectNotFoundError:
            pass
        handle = self.driver.create(LATEST_NAME)
        self.driver.write(handle, memoryview(encode_hint(step)))
        self.driver.close(handle)


def latest_from_tracker(self: Store, *, verified: bool = False) -> Checkpoint | None:
    """Megatron's ``load_checkpoint``: read the tracker file and load the iteration it names;
    without a readable tracker, "will not load any checkpoints and will start from random"."""
    hint = self.strategy.read_latest_hint()
    return None if hint is None else self.get(hint)


class RmtreeUnpublishCommit(RenameCommit):
    """Retention by ``shutil.rmtree(checkpoint_dir)`` (Megatron's and Lightning's removal of old
    checkpoints, ``rm -rf`` in an operator's cron job): the data goes before the metadata that
    makes the directory a checkpoint, so a crash leaves a "checkpoint" with shards missing."""

    def unpublish(self, step: int, epoch: int = 0) -> None:
        self.remove_tree(checkpoint_token(step, epoch))
        self.driver.fsync_dir("")


class ShortWritePosixDriver(PosixDriver):
    """A driver that calls ``write(2)`` once and ignores a short count: on FUSE (``max_write``),
    NFS, a pipe or after a signal, ``os.write`` writes fewer bytes than asked (Python documents
    it), and the rest of the shard is silently dropped."""

    MAX_WRITE = 4000

    def write(self, handle: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        with self._translate_handle("write", handle):
            os.write(handle, view[: self.MAX_WRITE])


def retention_counting_unfinished(self: Store, policy: Any = None) -> list[int]:
    """NeMo's ``nemo_topk_check_previous_run`` on resume: ``rglob("*.ckpt")`` counts every
    checkpoint file, finished or not, and removes the excess; here KeepLast counts staging
    attempts as checkpoints, and an unfinished newest one pushes a finished one out."""
    policy = policy or self.retention
    if policy is None:
        return []
    everything = set(self.steps())
    audit = audit_of(self.strategy)
    assert audit is not None
    for name in audit.raw_names():
        head = name.split("/", 1)[0].split(".", 1)[0]
        if head.startswith("step-") and head[5:].isdigit():
            everything.add(int(head[5:]))
    now = datetime.fromtimestamp(self.clock(), timezone.utc)
    keep = policy.keep([CheckpointAge(step, None) for step in sorted(everything)], now)
    doomed = [step for step in self.steps() if step not in keep]
    for step in doomed:
        self._history.unpublish(step)
    return doomed


def _steps_by_name(self: Store) -> list[int]:
    """Resume by file name: NeMo's ``exp_manager`` takes the first ``*last.ckpt`` that
    ``rglob`` finds, and name-sorted listings put ``step=9`` after ``step=12``."""
    return sorted(self._checkpoint_steps(self._history.steps()), key=str)


def latest_by_name(self: Store, *, verified: bool = False) -> Checkpoint | None:
    """The "newest" checkpoint by name order (see ``_steps_by_name``)."""
    steps = _steps_by_name(self)
    return self.get(steps[-1]) if steps else None


_real_begin = Store.begin


def begin_in_the_newest_epoch(self: Store, step: int, metadata: Any = None, **kwargs: Any) -> Any:
    """A writer that names no epoch joins the newest one by itself (the convenience §8.3
    forbids: every ``ckptstore push`` opens a fresh handle, so a zombie's push would publish
    into the new run's history)."""
    if self.epoch is None:
        newest = self.lineage().newest
        if newest:
            self.join_epoch(newest)
    return _real_begin(self, step, metadata, **kwargs)


def verify_sizes_only(self: Checkpoint, progress: Any = None) -> VerifyReport:
    """A verify that checks each shard is there with its recorded size, as ``rclone check
    --size-only`` or an ``ls -l`` audit does: a flipped bit passes."""
    report = VerifyReport(step=self.step)
    for name in self.names:
        record = self.shards[name]
        stream = self._opener(self.manifest, record)
        try:
            size = len(stream.read())
        finally:
            stream.close()
        report.bytes_checked += size
        if size != record.size:
            report.problems[name] = f"{size} bytes, manifest says {record.size}"
    return report


# -- object stores: S3 clones, R2, eventually consistent listings, client caches ----------


class IgnoresIfNoneMatchOnCompleteDriver(MemoryDriver):
    """An S3-compatible server that honours ``If-None-Match: *`` on PutObject and ignores it
    on CompleteMultipartUpload (the two calls got conditional writes separately, and not
    everywhere), while the driver declares both."""

    def complete_multipart(
        self,
        key: str,
        upload_id: str,
        parts: Sequence[PartInfo],
        *,
        mode: PutMode = PutMode.OVERWRITE,
    ) -> ObjectInfo:
        return super().complete_multipart(key, upload_id, parts)


class IgnoresIfMatchDriver(MemoryDriver):
    """An S3 clone that accepts ``If-Match`` on PutObject and ignores it: a compare-and-swap
    with a stale ETag overwrites (S3-compatible servers before S3 added conditional writes)."""

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: PutMode = PutMode.OVERWRITE,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        if mode.etag is not None:
            mode = PutMode.OVERWRITE
        return super().put(key, data, mode=mode, metadata=metadata)


class LaggingListDriver(MemoryDriver):
    """An eventually consistent listing (S3 before December 2020, Swift, many S3 gateways over
    a replicated index): the first listing after a write does not show the new key."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unlisted: set[str] = set()

    def put(self, key: str, data: Buffer, **kwargs: Any) -> ObjectInfo:
        info = super().put(key, data, **kwargs)
        self.unlisted.add(key)
        return info

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        listed = list(super().list(prefix, start_after=start_after))
        hidden = {info.key for info in listed} & self.unlisted
        self.unlisted -= hidden
        return iter([info for info in listed if info.key not in hidden])


class StaleDeleteListDriver(MemoryDriver):
    """A listing that lags deletes: a separately replicated bucket index still lists a deleted
    key in the next listing (eventually consistent S3 clones and gateways)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deleted: dict[str, ObjectInfo] = {}

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        try:
            self.deleted[key] = self.head(key)
        except ObjectNotFoundError:
            pass
        super().delete(key, version_id=version_id)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        listed = {info.key: info for info in super().list(prefix, start_after=start_after)}
        for key, info in list(self.deleted.items()):
            if key.startswith(prefix) and (start_after is None or key > start_after):
                listed.setdefault(key, info)
                del self.deleted[key]
        return iter(sorted(listed.values(), key=lambda info: info.key))


class FirstPageListDriver(MemoryDriver):
    """A driver that reads only the first page of ``ListObjectsV2`` (no paginator, or a server
    that answers ``IsTruncated: false`` early). S3 pages hold 1000 keys; this server's hold
    one, so that two checkpoints overflow a page: the newest keys, sorted last, are lost."""

    PAGE = 1

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        return iter(list(super().list(prefix, start_after=start_after))[: self.PAGE])


class ShortPagesDriver(MemoryDriver):
    """A server (or a proxy in front of a sound one) that drops the continuation token: every
    listing ends with its first page. S3's pages hold 1000 keys; this one's hold 3, and a page
    size asked for (``list_page_size``) is honoured, so that the probe sees it with 7 keys."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.list_page_size = 3

    def listing_page(
        self, snapshot: Sequence[ObjectInfo], start: int
    ) -> tuple[Sequence[ObjectInfo], int | None]:
        return super().listing_page(snapshot, start)[0], None


class LingeringDeletesDriver(MemoryDriver):
    """Deletes that linger: a deleted object is still read, found by HEAD and listed by the
    next few calls that touch it (a cache in front of the bucket index, a replica that lags),
    although its DELETE was answered."""

    LINGER = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lingering: dict[str, list[Any]] = {}

    def _still(self, key: str) -> tuple[bytes, ObjectInfo] | None:
        entry = self.lingering.get(key)
        if entry is None:
            return None
        entry[2] -= 1
        if entry[2] <= 0:
            del self.lingering[key]
        return entry[0], entry[1]

    def put_request(self, key: str, body: bytes, mode: PutMode, metadata: Any) -> Any:
        self.lingering.pop(key, None)
        return super().put_request(key, body, mode, metadata)

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        if version_id is None:
            with contextlib.suppress(ObjectNotFoundError):
                self.lingering[key] = [*self.read_whole(key, None), self.LINGER]
        super().delete(key, version_id=version_id)

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        still = self._still(key) if version_id is None else None
        return still if still is not None else super().read_whole(key, version_id)

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        still = self._still(key) if version_id is None else None
        return still[1] if still is not None else super().head(key, version_id=version_id)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        listed = {info.key: info for info in super().list(prefix, start_after=start_after)}
        for key in list(self.lingering):
            if key.startswith(prefix) and (start_after is None or key > start_after):
                still = self._still(key)
                if still is not None:
                    listed.setdefault(key, still[1])
        return iter(sorted(listed.values(), key=lambda info: info.key))


class ZeroSizeMultipartDriver(MemoryDriver):
    """A gateway that stats an object completed from parts by its manifest, not its data:
    HEAD and listings say 0 bytes, GET returns them all."""

    def _info(self, key: str, version: Any, is_latest: bool = True, *, listed: bool = False) -> Any:
        info = super()._info(key, version, is_latest, listed=listed)
        multipart = "-" in info.etag.strip('"')
        return dataclasses.replace(info, size=0) if multipart else info

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        data, info = super().read_whole(key, version_id)
        return data, dataclasses.replace(info, size=len(data))


class LocalTimeListingDriver(MemoryDriver):
    """Listings stamped in the server's local time zone (UTC+2), HEAD in UTC: a leftover's
    LastModified as GC lists it is two hours later than the clock GC reads by HEAD."""

    ZONE_S = 2 * 3600

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        for info in super().list(prefix, start_after=start_after):
            yield dataclasses.replace(info, last_modified=info.last_modified + self.ZONE_S)


class StaleAfterOverwriteDriver(MemoryDriver):
    """Reads that return stale data for a moment: after an object is overwritten, the next
    ``STALE_READS`` reads of it (GET or HEAD, not by version) return the old version (a
    read cache or a replica that lags overwrites, with read-after-write of new keys right).
    Sound for ckptstore, which never overwrites data and cross-checks the LATEST hint."""

    STALE_READS = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stale: dict[str, list[Any]] = {}
        self.stale_lock = threading.Lock()

    def put_request(self, key: str, body: bytes, mode: PutMode, metadata: Any) -> Any:
        request = super().put_request(key, body, mode, metadata)
        send = request.send

        def overwrite() -> ObjectInfo:
            try:
                before = super(StaleAfterOverwriteDriver, self).read_whole(key, None)
            except ObjectNotFoundError:
                before = None
            info = send()
            if before is not None:
                with self.stale_lock:
                    self.stale[key] = [*before, self.STALE_READS]
            return info

        return dataclasses.replace(request, send=overwrite)

    def _old(self, key: str) -> tuple[bytes, ObjectInfo] | None:
        with self.stale_lock:
            entry = self.stale.get(key)
            if entry is None:
                return None
            entry[2] -= 1
            if entry[2] <= 0:
                del self.stale[key]
            return entry[0], entry[1]

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        old = self._old(key) if version_id is None else None
        return old if old is not None else super().read_whole(key, version_id)

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        old = self._old(key) if version_id is None else None
        return old[1] if old is not None else super().head(key, version_id=version_id)


class PartsByNameDriver(MemoryDriver):
    """A gateway that keeps an upload's parts as files named by their number and assembles
    them in the order of those names: 1, 10, 11, 12, 13, 2, ... An upload of up to 9 parts
    comes out right, so only an upload of 10 parts or more shows it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bodies: dict[tuple[str, int], bytes] = {}

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Any) -> PartInfo:
        info = super().upload_part(key, upload_id, part_number, data)
        self.bodies[(upload_id, part_number)] = bytes(data)
        return info

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], **kwargs: Any
    ) -> ObjectInfo:
        info = super().complete_multipart(key, upload_id, parts, **kwargs)
        numbers = sorted((p.part_number for p in parts), key=str)
        with self.bucket.lock:
            version = self.bucket.objects[self.full(key)][-1]
            version.data = b"".join(self.bodies.pop((upload_id, n)) for n in numbers)
        return info


class HidesDotNamesDriver(MemoryDriver):
    """A gateway (and some FUSE file systems) that leaves names starting with ``.`` or ``_``
    out of listings, as hidden or system files: torch DCP's ``.metadata`` and
    ``__0_0.distcp`` among them. Reads by name still find them."""

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        listed = super().list(prefix, start_after=start_after)
        return iter(
            [i for i in listed if not any(s.startswith((".", "_")) for s in i.key.split("/"))]
        )


class BlindMarkerCommit(ConditionalPutCommit):
    """orbax's ``CommitFileTemporaryPath`` on GCS and S3: the checkpoint is committed by writing
    a marker (``commit_success.txt``) with a plain write, so a second writer's marker lands on
    the first's and both saves succeed."""

    def publish(self, manifest: Manifest) -> None:
        self._check_sealed(manifest)
        self.driver.put(self.manifest_key(manifest.step), manifest.encode())


class StaleReadCacheDriver(MemoryDriver):
    """A client-side read cache that is never revalidated (fsspec's ``filecache``, a FUSE
    mount's caches with an infinite TTL): a reader checksums the cached bytes, not the stored
    ones, so a shard damaged in storage reads as intact: the checksum is right, over the
    wrong bytes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache: dict[str, tuple[bytes, ObjectInfo]] = {}

    def get(self, key: str, *, version_id: str | None = None) -> tuple[bytes, ObjectInfo]:
        if version_id is None and key in self.cache:
            return self.cache[key]
        found = super().get(key, version_id=version_id)
        if version_id is None and not key.endswith(".json") and key != "LATEST":
            self.cache[key] = found
        return found


class IgnoresVersionIdDriver(MemoryDriver):
    """A "versioned" S3-compatible gateway that returns version ids but keeps one object per
    key, so that ``GET ?versionId=`` serves the current version."""

    def get(self, key: str, *, version_id: str | None = None) -> tuple[bytes, ObjectInfo]:
        return super().get(key)


class VisiblePartsDriver(MemoryDriver):
    """An S3 front end over a file system that appends each uploaded part to the final object
    as it arrives: an unfinished multipart upload is readable."""

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        info = super().upload_part(key, upload_id, part_number, data)
        with self.bucket.lock:
            upload = self.bucket.uploads[upload_id]
            body = b"".join(upload.parts[n][0] for n in sorted(upload.parts))
            self.bucket.objects[upload.key] = [
                _Version("null", body, '"partial"', self.bucket.clock())
            ]
        return info


class SilentRefusalDriver(MemoryDriver):
    """An S3 clone that answers 200 to ``If-None-Match: *`` on an existing key and keeps the
    old object (seen behind an S3-compatible proxy): the loser of a race is told it won."""

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: PutMode = PutMode.OVERWRITE,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        if mode.kind == "create":
            try:
                return self.head(key)
            except ObjectNotFoundError:
                pass
        return super().put(key, data, mode=mode, metadata=metadata)


class BlindRetryCommit(ConditionalPutCommit):
    """A publish that retries a conditional PUT whose answer was lost and takes the retry's 412
    for another writer's checkpoint (what an SDK's automatic retry of ``If-None-Match: *``
    does): its own first try had taken effect."""

    def publish(self, manifest: Manifest) -> None:
        self._check_sealed(manifest)
        key, body = self.manifest_key(manifest.step), manifest.encode()
        for _ in range(3):
            try:
                self.driver.put(key, body, mode=PutMode.CREATE)
                return
            except PreconditionFailedError:
                raise self._exists(manifest, None) from None
            except TransientStorageError:
                continue


# -- variants only a suite feature still on another branch can catch -----------------------


class NoopFsyncPosixDriver(PosixDriver):
    """Lying fsync: the call returns success and persists nothing (a driver that "optimises"
    fsync away, ``eatmydata``, a disk cache that acknowledges flushes it has not done). Real
    crashes keep the page cache, and the power-loss layer simulates the strategy's calls, not
    this driver's: only a trace of the driver's own system calls can see it."""

    def fsync(self, handle: int) -> None:
        return None

    def fsync_dir(self, path: str) -> None:
        return None


class WrongDescriptorFsyncPosixDriver(PosixDriver):
    """fsync on the wrong descriptor: each file's fsync syncs the store's root directory
    instead (a handle mix-up), so the call succeeds and the file's data stays volatile."""

    def fsync(self, handle: int) -> None:
        super().fsync_dir("")


class CheckThenPutDriver(MemoryDriver):
    """A conditional create checked apart from the write (a HEAD, then the PUT, as S3 gateways
    over a key-value store without transactions implement it): two racing creates can both
    pass the check, and the later write wins."""

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: PutMode = PutMode.OVERWRITE,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        if mode.kind != "create":
            return super().put(key, data, mode=mode, metadata=metadata)
        try:
            self.head(key)
        except ObjectNotFoundError:
            with _between_check_and_write(key):
                return super().put(key, data, metadata=metadata)
        raise PreconditionFailedError(f"{self.url}/{key}: object exists", http_status=412)


_CHECKED = threading.Condition()
_PAST_THE_CHECK: dict[str, int] = {}
_ROUND_TRIP_S = 0.25
"""How long a create that passed the check waits for a racing one (the gateway's round trip
between check and write, as long as a loaded machine's scheduling may stagger racers)."""


@contextlib.contextmanager
def _between_check_and_write(key: str) -> Iterator[None]:
    """The window between the check and the write, opened for every create of ``key`` racing
    this one: the write waits until another create of the key has passed its check too (or
    ``_ROUND_TRIP_S``), so that racing creates all pass, whatever the machine's load."""
    with _CHECKED:
        _PAST_THE_CHECK[key] = _PAST_THE_CHECK.get(key, 0) + 1
        _CHECKED.notify_all()
        _CHECKED.wait_for(lambda: _PAST_THE_CHECK[key] >= 2, timeout=_ROUND_TRIP_S)
    try:
        yield
    finally:
        with _CHECKED:
            _PAST_THE_CHECK[key] -= 1
            if not _PAST_THE_CHECK[key]:
                del _PAST_THE_CHECK[key]


class InitiationAgedGcCommit(ConditionalPutCommit):
    """GC that ages a multipart upload by its initiation, as S3's lifecycle rule
    ``AbortIncompleteMultipartUpload`` does: an upload that runs longer than the grace period
    is aborted while its parts are still arriving."""

    def _upload_progress(self, upload: UploadInfo) -> UploadProgress:
        return UploadProgress(upload.initiated, 0, 0)


class UnfinishedRemovingGcCommit(RenameCommit):
    """Cleanup of "unfinished" checkpoints by the look of them (NeMo removes checkpoints it
    marked unfinished on resume; scripts remove step directories without metadata): every
    step-named directory without a manifest goes, an operator's partial copy included."""

    def _collect(self, name: str, now: float, report: GcReport) -> None:
        step = parse_step_token(name)
        if step is not None:
            try:
                self.driver.stat(f"{name}/{MANIFEST_NAME}")
            except ObjectNotFoundError:
                report.removed.append(GcItem(kind="unfinished", name=name, age_s=0.0))
                if not report.dry_run:
                    self.remove_tree(name)
                return
        super()._collect(name, now, report)


class StepPrefixAbortCommit(ConditionalPutCommit):
    """The loser of a race cleans up by the step's prefix, not its attempt's (``rm -r
    step-N*``; orbax and NeMo remove "unfinished" checkpoints by name): it deletes the
    winner's shards along with its own."""

    def abort(self, step: int, attempt: str) -> None:
        for info in list(self.driver.list(step_token(step))):
            self.driver.delete(info.key)


# -- tiered pairs: a replicator blind to the durable lineage --------------------------------


class HistoryBlindReplicator(Replicator):
    """A replicator that copies whatever the fast tier publishes above the durable newest, as
    tiered stores did before the pair kept one history: a node that was cut off from the
    durable store while another took the pair over copies its own branch into the new run's
    history when the job restarts on it (issue 24 item 5)."""

    def holds(self, manifest: Manifest, lineage: Lineage) -> bool:
        return True


# -- incremental saves on object stores (docs/protocol.md §12.3) ------------------------------


class _NoDoomLeases(BlobLeases):
    """GC that deletes a blob once it judged every user dead, without first dooming its
    lease by a CAS from the state it judged: a writer that appended itself meanwhile is not
    seen (the mark-and-sweep of a GC that does not stop the world)."""

    def _collect_blob(  # type: ignore[override]
        self, report: GcReport, blob: BlobName, listed: Any, generations: Any, uploads: Any,
        now: float, published: Any, alive: Any,
    ) -> None:  # fmt: skip
        lease, _ = self.read(blob)
        if lease is None or any(published(u) or alive(u) for u in lease.users):
            return
        for info in generations.values():  # every generation listed, the current one too
            report.removed.append(GcItem("blob", info.key, 0.0, info.size))
            self.driver.delete(info.key)


class GcWithoutDoomCommit(ConditionalPutCommit):
    """Shares blobs as ckptstore does; its GC deletes without the doom CAS."""

    def __init__(self, driver: Any, **settings: Any) -> None:
        super().__init__(driver, **settings)
        # A writer that shares a blob this GC deleted waits for bytes that never come: briefly
        self._blobs = _NoDoomLeases(driver, self._open_blob_sink, share_wait_s=0.5)


class _CheckThenAppendLeases(BlobLeases):
    """A writer that checks the blob's bytes are there, then records its use: appended to
    whatever lease it reads next, a doomed one revived (its doom ignored), and the bytes it
    checked before trusted (the check-then-act of a reference count kept beside the data)."""

    def share(
        self, step: int, attempt: str, blob: BlobName, data: ShardBytes
    ) -> Mapping[str, str] | None:
        self.touch(step, attempt)
        lease, _ = self.read(blob)
        if lease is None or lease.doomed:
            return super().share(step, attempt, blob, data)
        info = self.driver.head(blob.generation_key(lease.generation))  # checked first
        me = User(step, attempt)
        while True:
            current, etag = self.read(blob)
            assert current is not None and etag is not None
            users = current.users if me in current.users else (*current.users, me)
            revived = dataclasses.replace(current, doomed=False, users=users)
            try:
                self.driver.put(blob.lease_key, revived.encode(), mode=PutMode.update(etag))
            except PreconditionFailedError:
                continue
            return self.locator(blob, lease.generation, info)


class CheckThenAppendCommit(ConditionalPutCommit):
    """Shares blobs by checking them before it appends itself to their lease."""

    def __init__(self, driver: Any, **settings: Any) -> None:
        super().__init__(driver, **settings)
        self._blobs = _CheckThenAppendLeases(driver, self._open_blob_sink)


class _SizeBlindLeases(BlobLeases):
    """A writer that trusts a blob's name (its digest) without its object's size or ETag:
    the object at the name is taken for the blob, whatever it holds."""

    @staticmethod
    def _holds_the_blob(info: ObjectInfo, blob: BlobName, lease: Any) -> bool:
        return True


class SizeBlindCommit(ConditionalPutCommit):
    """Shares a blob by its digest alone: the object at the blob's name is the blob, when it
    decides and when it seals (content-addressed stores that check a chunk by its name)."""

    def __init__(self, driver: Any, **settings: Any) -> None:
        super().__init__(driver, **settings)
        self._blobs = _SizeBlindLeases(driver, self._open_blob_sink)

    def _stored_problem(self, record: Any) -> Any:
        problem = super()._stored_problem(record)
        if problem is not None and not problem.missing and "blob" in record.locator:
            return None  # it exists under the blob's name: taken for the blob
        return problem


class _ListedUsersLeases(BlobLeases):
    """GC that judges a blob's users published by a listing of manifests (one listing for
    the whole pass, as a mark phase would), not by reading each user's manifest."""

    def collect(self, report: GcReport, *, now: float, published: Any, last_activity: Any) -> None:
        listed = {
            parse_step_token(info.key.removeprefix(MANIFESTS).split(".")[0])
            for info in self.driver.list(MANIFESTS)
        }
        super().collect(
            report, now=now, published=lambda user: user.step in listed,
            last_activity=last_activity,
        )  # fmt: skip


class ListedUsersGcCommit(ConditionalPutCommit):
    """Collects blobs judging users by a listing of manifests."""

    def __init__(self, driver: Any, **settings: Any) -> None:
        super().__init__(driver, **settings)
        self._blobs = _ListedUsersLeases(driver, self._open_blob_sink)
