"""In-process object store with exactly S3's semantics: the reference model of the protocol.

``memory://name/prefix`` opens a store in the bucket ``name``, which lives as long as the
process. Puts are atomic; ``If-None-Match: *`` and ``If-Match: <etag>`` are honoured on put and
on multipart completion; multipart parts are invisible until completed and must be at least
``min_part_size`` bytes except the last; a versioned bucket keeps every version and turns a
plain DELETE into a delete marker. The conformance suite uses it as its oracle, so it is kept
exact rather than convenient.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from ckptstore.backends.object_store import S3_LIKE, ObjectStoreBase, PutRequest
from ckptstore.commit.conditional_put import DEFAULT_PART_SIZE, ConditionalPutCommit
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.driver import Capability, ObjectInfo, PartInfo, PutMode, UploadInfo, UploadProgress
from ckptstore.errors import (
    InvalidOptionError,
    InvalidURLError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    StoreNotFoundError,
)
from ckptstore.urls import StoreURL, option_bool, option_int

if TYPE_CHECKING:
    from ckptstore.driver import Buffer

__all__ = ["MemoryBucket", "MemoryDriver", "drop_bucket", "get_bucket", "open_memory"]

S3_MIN_PART_SIZE = 5 * 1024 * 1024
S3_MAX_PARTS = 10_000
Clock = Callable[[], float]


@dataclass
class _Version:
    version_id: str
    data: bytes
    etag: str
    last_modified: float
    is_delete_marker: bool = False
    metadata: Mapping[str, str] | None = None


@dataclass
class _Upload:
    key: str
    initiated: float
    parts: dict[int, tuple[bytes, str]] = field(default_factory=dict)
    part_times: dict[int, float] = field(default_factory=dict)
    metadata: Mapping[str, str] | None = None


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


def _same_etag(a: str, b: str) -> bool:
    return a.strip('"') == b.strip('"')


class MemoryBucket:
    """One in-memory bucket: versions per key, multipart uploads, a clock for timestamps."""

    def __init__(
        self,
        name: str,
        *,
        versioned: bool = False,
        min_part_size: int = S3_MIN_PART_SIZE,
        clock: Clock = time.time,
    ) -> None:
        self.name = name
        self.versioned = versioned
        self.min_part_size = min_part_size
        self.clock = clock
        self.lock = threading.RLock()
        self.objects: dict[str, list[_Version]] = {}  # oldest first
        self.uploads: dict[str, _Upload] = {}
        self._sequence = itertools.count(1)

    def new_version_id(self) -> str:
        if not self.versioned:
            return "null"
        return f"{next(self._sequence):012d}{secrets.token_hex(4)}"

    def current(self, key: str) -> _Version | None:
        """The newest version of ``key`` unless it is a delete marker."""
        versions = self.objects.get(key)
        if not versions or versions[-1].is_delete_marker:
            return None
        return versions[-1]

    def find(self, key: str, version_id: str | None) -> _Version:
        """The version asked for (the current one when ``version_id`` is None)."""
        if version_id is None:
            found = self.current(key)
        else:
            found = next((v for v in self.objects.get(key, []) if v.version_id == version_id), None)
            if found is not None and found.is_delete_marker:
                found = None
        if found is None:
            detail = f" version {version_id}" if version_id else ""
            raise ObjectNotFoundError(2, f"memory://{self.name}/{key}{detail}: no such object")
        return found

    def store(
        self,
        key: str,
        data: bytes,
        etag: str,
        metadata: Mapping[str, str] | None = None,
        *,
        now: float | None = None,
    ) -> _Version:
        """Add (versioned) or replace (unversioned) the object at ``key``, stamped ``now``
        (default: the bucket's clock)."""
        stamp = self.clock() if now is None else now
        version = _Version(self.new_version_id(), data, etag, stamp, metadata=metadata)
        if self.versioned:
            self.objects.setdefault(key, []).append(version)
        else:
            self.objects[key] = [version]
        return version

    def check_conditions(self, key: str, mode: PutMode) -> None:
        """Raise as S3 does when a conditional write's precondition does not hold."""
        current = self.current(key)
        if mode.kind == "create" and current is not None:
            raise PreconditionFailedError(
                f"memory://{self.name}/{key}: object exists", http_status=412
            )
        if mode.etag is not None:
            if current is None:
                raise ObjectNotFoundError(2, f"memory://{self.name}/{key}: no such object")
            if not _same_etag(current.etag, mode.etag):
                raise PreconditionFailedError(
                    f"memory://{self.name}/{key}: etag changed", http_status=412
                )


_BUCKETS: dict[str, MemoryBucket] = {}
_BUCKETS_LOCK = threading.Lock()


def get_bucket(name: str, **settings: object) -> MemoryBucket:
    """Return the process-wide bucket ``name``, creating it with ``settings`` if new.

    Settings given for an existing bucket must match it: a bucket does not change its nature.
    """
    with _BUCKETS_LOCK:
        bucket = _BUCKETS.get(name)
        if bucket is None:
            bucket = MemoryBucket(name, **settings)  # type: ignore[arg-type]
            _BUCKETS[name] = bucket
            return bucket
    for key, value in settings.items():
        if getattr(bucket, key) != value:
            raise InvalidOptionError(
                f"memory://{name} exists with {key}={getattr(bucket, key)!r}, not {value!r}"
            )
    return bucket


def drop_bucket(name: str) -> None:
    """Forget a bucket and everything in it."""
    with _BUCKETS_LOCK:
        _BUCKETS.pop(name, None)


class MemoryDriver(ObjectStoreBase):
    """Object-store primitives on a MemoryBucket under a key prefix."""

    scheme = "memory"
    max_parts = S3_MAX_PARTS
    process_local = True
    """Its data lives in this process: another process that opens the URL sees an empty bucket."""

    def __init__(self, bucket: MemoryBucket, prefix: str = "") -> None:
        super().__init__(bucket.name, prefix, url=None)
        self.bucket = bucket
        self.storage_identity = ("", f"{bucket.name}#{id(bucket)}")  # in-process: this one
        self.clock: Clock | None = None
        """Where this driver's writes take their timestamps (None: the bucket's clock). The
        conformance suite sets its own, so that the time it makes pass passes for the storage
        too."""
        if bucket.versioned:
            self.url = "memory+versioned" + self.url[len("memory") :]
        self.min_part_size = bucket.min_part_size
        caps = {Capability.CONDITIONAL_MULTIPART_COMPLETE}
        if bucket.versioned:
            caps.update({Capability.VERSIONING, Capability.VERSION_DELETE})
        self.capabilities = S3_LIKE | caps

    def _now(self) -> float:
        return (self.clock or self.bucket.clock)()

    def _info(
        self, key: str, version: _Version, is_latest: bool = True, *, listed: bool = False
    ) -> ObjectInfo:
        return ObjectInfo(
            key=key,
            size=len(version.data),
            etag=version.etag,
            last_modified=version.last_modified,
            version_id=version.version_id if self.bucket.versioned else None,
            is_delete_marker=version.is_delete_marker,
            is_latest=is_latest,
            metadata=None if listed else dict(version.metadata or {}),  # S3 lists none
        )

    def check_bucket(self) -> None:
        with _BUCKETS_LOCK:
            if _BUCKETS.get(self.bucket.name) is not self.bucket:
                raise StoreNotFoundError(f"memory://{self.bucket.name}: bucket was dropped")

    def put_request(
        self, key: str, body: bytes, mode: PutMode, metadata: Mapping[str, str] | None
    ) -> PutRequest:
        def store() -> ObjectInfo:
            full = self.full(key)
            with self.bucket.lock:
                self.bucket.check_conditions(full, mode)
                stored = self.bucket.store(full, body, _etag(body), metadata, now=self._now())
                return self._info(key, stored)

        return PutRequest(f"PutObject {key}", store)

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        with self.bucket.lock:
            version = self.bucket.find(self.prefix + key, version_id)
            return version.data, self._info(key, version)

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        return io.BytesIO(self.get(key, version_id=version_id)[0])

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        with self.bucket.lock:
            return self._info(key, self.bucket.find(self.prefix + key, version_id))

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        full = self.prefix + key
        with self.bucket.lock:
            versions = self.bucket.objects.get(full, [])
            if version_id is not None:
                versions[:] = [v for v in versions if v.version_id != version_id]
            elif self.bucket.versioned:
                marker = _Version(self.bucket.new_version_id(), b"", "", self._now(), True)
                versions.append(marker)
                self.bucket.objects[full] = versions
            else:
                versions.clear()
            if not versions:
                self.bucket.objects.pop(full, None)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        full_prefix = self.prefix + prefix
        after = self.prefix + start_after if start_after is not None else None
        with self.bucket.lock:
            snapshot = []
            for full in sorted(self.bucket.objects):
                if not full.startswith(full_prefix) or (after is not None and full <= after):
                    continue
                current = self.bucket.current(full)
                if current is not None:
                    snapshot.append(self._info(full[len(self.prefix) :], current, listed=True))
        if not self.list_page_size:
            return iter(snapshot)
        return self.pages(f"listing {prefix}", lambda at: self.listing_page(snapshot, at or 0))

    def listing_page(
        self, snapshot: Sequence[ObjectInfo], start: int
    ) -> tuple[Sequence[ObjectInfo], int | None]:
        """One page of a listing (``list_page_size`` entries from ``start``) and where the
        next starts (None: the last page), as a server pages a listing by continuation token."""
        end = start + (self.list_page_size or len(snapshot))
        return snapshot[start:end], end if end < len(snapshot) else None

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        full_prefix = self.prefix + prefix
        with self.bucket.lock:
            snapshot = []
            for full in sorted(self.bucket.objects):
                if full.startswith(full_prefix):
                    versions = self.bucket.objects[full]
                    for index, version in enumerate(reversed(versions)):
                        relative = full[len(self.prefix) :]
                        snapshot.append(self._info(relative, version, index == 0, listed=True))
        return iter(snapshot)

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        upload_id = secrets.token_hex(12)
        with self.bucket.lock:
            self.bucket.uploads[upload_id] = _Upload(
                self.prefix + key, self._now(), metadata=metadata
            )
        return upload_id

    def _upload(self, key: str, upload_id: str) -> _Upload:
        upload = self.bucket.uploads.get(upload_id)
        if upload is None or upload.key != self.prefix + key:
            raise ObjectNotFoundError(2, f"{self.url}/{key}: no such upload {upload_id}")
        return upload

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        if not 1 <= part_number <= self.max_parts:
            raise StorageError(22, f"{self.url}/{key}: part number {part_number} out of range")
        body = bytes(data)
        etag = _etag(body)
        with self.bucket.lock:
            upload = self._upload(key, upload_id)
            upload.parts[part_number] = (body, etag)
            upload.part_times[part_number] = self._now()
        return PartInfo(part_number=part_number, etag=etag, size=len(body))

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        mode = PutMode.CREATE if create else PutMode.OVERWRITE
        with self.bucket.lock:
            upload = self._upload(key, upload_id)
            numbers = [p.part_number for p in parts]
            if not parts or numbers != sorted(set(numbers)):
                raise StorageError(22, f"{self.url}/{key}: parts must be ascending and unique")
            chunks = []
            for index, part in enumerate(parts):
                stored = upload.parts.get(part.part_number)
                if stored is None or not _same_etag(stored[1], part.etag):
                    raise StorageError(22, f"{self.url}/{key}: part {part.part_number} invalid")
                if index < len(parts) - 1 and len(stored[0]) < self.min_part_size:
                    raise StorageError(
                        22, f"{self.url}/{key}: part {part.part_number} is too small"
                    )
                chunks.append(stored[0])
            self.bucket.check_conditions(upload.key, mode)
            digest = hashlib.md5(usedforsecurity=False)
            for _body, etag in (upload.parts[n] for n in numbers):
                digest.update(bytes.fromhex(etag.strip('"')))
            etag = f'"{digest.hexdigest()}-{len(parts)}"'
            version = self.bucket.store(
                upload.key, b"".join(chunks), etag, upload.metadata, now=self._now()
            )
            del self.bucket.uploads[upload_id]
            return self._info(key, version)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        with self.bucket.lock:
            self._upload(key, upload_id)
            del self.bucket.uploads[upload_id]

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        full_prefix = self.prefix + prefix
        with self.bucket.lock:
            snapshot = [
                UploadInfo(u.key[len(self.prefix) :], upload_id, u.initiated)
                for upload_id, u in self.bucket.uploads.items()
                if u.key.startswith(full_prefix)
            ]
        return iter(sorted(snapshot, key=lambda u: (u.key, u.initiated)))

    def bucket_versioning(self) -> str:
        return "Enabled" if self.bucket.versioned else ""

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        with self.bucket.lock:
            found = self._upload(upload.key, upload.upload_id)
            return UploadProgress(
                last_activity=max([found.initiated, *found.part_times.values()]),
                size=sum(len(body) for body, _etag in found.parts.values()),
                parts=len(found.parts),
            )


def open_memory(url: StoreURL, options: Mapping[str, object]) -> ConditionalPutCommit:
    """Open a ``memory://bucket/prefix`` store: MemoryDriver + ConditionalPutCommit
    (``memory+versioned://``: a versioned bucket + VersionPinCommit).

    Options: ``versioned`` and ``min_part_size`` apply when the bucket is first created (use
    ``get_bucket`` to give it a clock); ``part_size`` is the upload part size (at least the
    bucket's minimum part size); ``concurrency`` is how many parts upload at once.
    """
    url.reject_unknown(options, allowed=("versioned", "min_part_size", "part_size", "concurrency"))
    if not url.netloc:
        raise InvalidURLError(f"{url.shown}: memory:// URLs name a bucket: memory://bucket/prefix")
    if url.scheme == "memory+versioned" and "versioned" not in options:
        options = {**options, "versioned": True}
    settings: dict[str, object] = {}
    if "versioned" in options:
        settings["versioned"] = option_bool(options, "versioned", False)
    if "min_part_size" in options:
        settings["min_part_size"] = option_int(options, "min_part_size", 0, minimum=1)
    bucket = get_bucket(url.netloc, **settings)
    driver = MemoryDriver(bucket, url.path)
    part_size = option_int(
        options, "part_size", max(DEFAULT_PART_SIZE, bucket.min_part_size), minimum=1
    )
    concurrency = option_int(options, "concurrency", 1, minimum=1)
    if url.scheme == "memory+versioned":
        return VersionPinCommit(driver, part_size=part_size, concurrency=concurrency)
    return ConditionalPutCommit(driver, part_size=part_size, concurrency=concurrency)
