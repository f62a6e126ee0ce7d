"""The driver interface: the primitive operations of one storage system, and nothing more.

A driver is small, dumb and swappable. It knows nothing of steps, manifests or attempts; the
commit strategies (``ckptstore.commit``) build the protocol from these calls. Every storage side
effect ckptstore has goes through exactly one of these calls, which is what lets the conformance
suite wrap a driver and crash it before or after any one of them.

Two families exist: file systems (write, fsync, rename; paths relative to the store's root
directory) and object stores (put, conditional put, multipart, versions; keys relative to the
store's prefix). Drivers translate their storage's errors into ``ckptstore.errors.StorageError``
subclasses.
"""

from __future__ import annotations

import enum
import inspect
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, ClassVar, Literal, Protocol, runtime_checkable

from ckptstore.errors import (
    IndeterminateOutcomeError,
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    PreconditionInferredError,
    StorageError,
    TargetExistsError,
    TransientStorageError,
)

__all__ = [  # the errors a driver raises are part of its interface
    "Buffer",
    "BytesLike",
    "Capability",
    "CloningDriver",
    "ClosableDriver",
    "DriverFamily",
    "FileStat",
    "FileSystemDriver",
    "IdentifiedStorage",
    "IndeterminateOutcomeError",
    "LinkInfo",
    "LinkingDriver",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectStoreDriver",
    "PartInfo",
    "PreconditionFailedError",
    "PreconditionInferredError",
    "PutMode",
    "RangedReadDriver",
    "StorageError",
    "TargetExistsError",
    "TransientStorageError",
    "UploadInfo",
    "UploadProgress",
    "driver_family",
    "multipart_mode",
    "storage_calls",
]

Buffer = bytes | bytearray | memoryview
"""The bytes a driver call takes."""

if sys.version_info >= (3, 12):
    from collections.abc import Buffer as BytesLike
else:
    from typing_extensions import Buffer as BytesLike
"""Any object with the buffer protocol (bytes, bytearray, memoryview, array, a NumPy array):
what a shard is written from and read into."""


class Capability(enum.Enum):
    """A guarantee a storage system may or may not provide (docs/protocol.md §2)."""

    RENAME_NOREPLACE = "rename-noreplace"
    """A rename that fails, atomically, when the target exists."""
    DURABLE_FSYNC = "durable-fsync"
    """fsync of files and directories makes their data and entries survive power loss."""
    CONDITIONAL_CREATE = "conditional-create"
    """PutObject with If-None-Match: * fails when the key exists."""
    CONDITIONAL_MULTIPART_COMPLETE = "conditional-multipart-complete"
    """CompleteMultipartUpload honours If-None-Match: *."""
    COMPARE_AND_SWAP = "compare-and-swap"
    """PutObject with If-Match: <etag> fails when the object changed."""
    VERSIONING = "versioning"
    """Every put creates a new version that can be read by its id."""
    VERSION_DELETE = "version-delete"
    """Deleting one version by its id removes exactly that version, for good."""
    MULTIPART = "multipart"
    """Objects can be uploaded in parts, invisible until completed."""
    SERVER_CHECKSUMS = "server-checksums"
    """The server validates CRC32C checksums sent with the data."""
    STRONG_LIST_AFTER_WRITE = "strong-list-after-write"
    """A completed write is seen by every later listing."""


class DriverFamily(enum.Enum):
    """Which primitive calls a driver offers: a file system's or an object store's."""

    FILE_SYSTEM = "file system"
    OBJECT_STORE = "object store"


@dataclass(frozen=True)
class PutMode:
    """What a put, or a multipart completion, does when its key already holds an object.

    ``PutMode.OVERWRITE`` replaces it. ``PutMode.CREATE`` (``If-None-Match: *``) takes effect
    only if the key holds nothing, else raises PreconditionFailedError. ``PutMode.update(etag)``
    (``If-Match``) takes effect only while the object's ETag is ``etag``: PreconditionFailedError
    if it changed, ObjectNotFoundError if there is none. One mode per call: a write is never
    both a create and an update.
    """

    kind: Literal["overwrite", "create", "update"]
    etag: str | None = None

    OVERWRITE: ClassVar[PutMode]
    CREATE: ClassVar[PutMode]

    def __post_init__(self) -> None:
        if self.kind not in ("overwrite", "create", "update"):
            raise InvalidInputError(f"unknown put mode {self.kind!r}")
        if (self.kind == "update") != bool(self.etag):
            raise InvalidInputError("an update put needs the ETag it expects, and only it does")

    @classmethod
    def update(cls, etag: str) -> PutMode:
        """Replace the object only while its ETag is ``etag`` (quoted or not)."""
        return cls("update", etag)

    @property
    def conditional(self) -> bool:
        """A create or an update: a commit point on object stores."""
        return self.kind != "overwrite"


PutMode.OVERWRITE = PutMode("overwrite")
PutMode.CREATE = PutMode("create")


@dataclass(frozen=True)
class FileStat:
    """What a file system says of one path."""

    size: int
    mtime: float
    is_dir: bool


@dataclass(frozen=True)
class LinkInfo:
    """What a file system says of one regular file's names (``LinkingDriver.links``)."""

    count: int
    """Its link count: how many names it has."""
    changed: float
    """When its inode last changed (a link or unlink changes it), on the file system's clock."""
    file_id: tuple[int, int]
    """Which file it is (device and inode): the same for every name of one file."""


@dataclass(frozen=True)
class ObjectInfo:
    """What an object store says of one object or object version."""

    key: str
    size: int
    etag: str
    last_modified: float
    version_id: str | None = None
    is_delete_marker: bool = False
    is_latest: bool = True
    metadata: Mapping[str, str] | None = field(default=None, compare=False, hash=False)
    """User metadata (``x-amz-meta-*``) where the call returns it (HEAD, GET); listings don't."""


@dataclass(frozen=True)
class PartInfo:
    """A completed part of a multipart upload."""

    part_number: int
    etag: str
    size: int
    checksum_crc32c: str | None = None
    """The part's CRC32C as S3 encodes it (base64 of 4 big-endian bytes), where sent."""


@dataclass(frozen=True)
class UploadInfo:
    """An incomplete multipart upload."""

    key: str
    upload_id: str
    initiated: float


@dataclass(frozen=True)
class UploadProgress:
    """What an incomplete multipart upload has received so far (S3 ListParts)."""

    last_activity: float
    """When it last received a part (its initiation if none)."""
    size: int
    """The bytes of the parts it holds: what aborting it frees."""
    parts: int


@runtime_checkable
class FileSystemDriver(Protocol):
    """Primitive file-system calls under one root directory; paths are relative, '/'-separated.

    The empty path is the root itself. Nothing here is durable until ``fsync`` (files) and
    ``fsync_dir`` (directory entries) say so.
    """

    family: ClassVar[DriverFamily] = DriverFamily.FILE_SYSTEM
    url: str
    capabilities: frozenset[Capability]

    def ensure_root(self, create: bool) -> None:
        """Check the root directory exists (creating it and its parents if ``create``)."""

    def mkdir(self, path: str) -> None:
        """Create one directory; its parent must exist; fail if it exists."""

    def create(self, path: str) -> int:
        """Create a new, empty file exclusively (fail if it exists); return a handle."""

    def write(self, handle: int, data: Buffer) -> None:
        """Append all of ``data`` to the open file."""

    def start_writeback(self, handle: int) -> None:
        """Start writing the open file's data to storage without waiting; promises nothing.

        A hint that lets the writeback of one shard overlap the writing of the next; only
        ``fsync`` makes data durable. Drivers without such a call do nothing.
        """

    def fsync(self, handle: int) -> None:
        """Make the open file's data durable."""

    def close(self, handle: int) -> None:
        """Close the handle (no durability implied)."""

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creations, renames, removals) durable."""

    def rename_noreplace(self, src: str, dst: str) -> None:
        """Atomically rename; raise TargetExistsError and change nothing if ``dst`` exists."""

    def rename_replace(self, src: str, dst: str) -> None:
        """Atomically rename a file over ``dst`` (which may exist)."""

    def listdir(self, path: str) -> list[str]:
        """Return the entry names of a directory, sorted."""

    def stat(self, path: str) -> FileStat:
        """Return size, mtime and kind of a path (not following a final symlink)."""

    def open_read(self, path: str) -> BinaryIO:
        """Open a file for streaming reads."""

    def unlink(self, path: str) -> None:
        """Remove a file."""

    def rmdir(self, path: str) -> None:
        """Remove an empty directory."""


class CloningDriver(FileSystemDriver, Protocol):
    """A file system that also makes copy-on-write clones of files (reflinks).

    Optional: a driver without ``clone`` works unchanged (a directory's files are then
    copied into a checkpoint). With it, ``publish_directory(clone=True)`` makes each shard a
    clone of the file it publishes, no byte copied, where the file is on the same file system.
    """

    def clone(self, handle: int, source: int) -> bool:
        """Make the new, empty file ``handle`` a clone of the whole open file ``source``;
        False, with nothing changed, where no clone can be made (a file system without
        clones, or two file systems). Durable once ``handle`` is fsynced."""


@runtime_checkable
class LinkingDriver(FileSystemDriver, Protocol):
    """A file system that also makes hard links: incremental saves share unchanged shards.

    Optional: a driver without ``link`` writes every shard of an incremental save (nothing
    is shared). With it, a shard whose bytes an earlier checkpoint holds becomes a new link
    to that checkpoint's file (docs/protocol.md, "Incremental checkpoints").
    """

    def link(self, source: str, target: str) -> int:
        """Make the new name ``target`` a hard link to the regular file ``source`` (never
        following a symbolic link); return the file's size. TargetExistsError if ``target``
        exists, ObjectNotFoundError if ``source`` does not, StorageError (nothing left at
        ``target``) if ``source`` is not a regular file. Durable once ``target``'s directory
        is fsynced."""

    def links(self, path: str) -> LinkInfo:
        """What the regular file ``path`` is: its link count, when its inode last changed
        and which file it is (two names of one file answer the same). StorageError if it is
        not a regular file."""


@runtime_checkable
class ObjectStoreDriver(Protocol):
    """Primitive object-store calls under one bucket and prefix; keys are relative to the prefix.

    Semantics are S3's: a put is atomic and visible whole or not at all; conditional puts and
    multipart completions either take effect or raise PreconditionFailedError.
    """

    family: ClassVar[DriverFamily] = DriverFamily.OBJECT_STORE
    url: str
    capabilities: frozenset[Capability]
    min_part_size: int
    max_parts: int

    def check_bucket(self) -> None:
        """Raise StoreNotFoundError / StorageAccessDeniedError unless the bucket is usable."""

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: PutMode = PutMode.OVERWRITE,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        """Store ``data`` at ``key`` atomically, as ``mode`` allows (see PutMode).

        ``metadata``: user metadata stored with the object (ASCII keys and values), returned
        by ``head`` and ``get``.
        """

    def get(self, key: str, *, version_id: str | None = None) -> tuple[bytes, ObjectInfo]:
        """Return an object's bytes (the newest version unless ``version_id``) and its info."""

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        """Open an object (or one version of it) for streaming reads."""

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        """Return an object's info; raise ObjectNotFoundError when absent."""

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        """Delete an object (adds a delete marker on a versioned bucket) or one version of it."""

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Yield the current objects under ``prefix`` in key order, after ``start_after``."""

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        """Yield every version and delete marker under ``prefix``."""

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        """Start a multipart upload (its object gets ``metadata``); return its upload id."""

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        """Upload one part (numbered from 1)."""

    def complete_multipart(
        self,
        key: str,
        upload_id: str,
        parts: Sequence[PartInfo],
        *,
        mode: PutMode = PutMode.OVERWRITE,
    ) -> ObjectInfo:
        """Assemble the parts into the object, atomically; ``mode`` is OVERWRITE or CREATE
        (an update is refused with InvalidInputError: no protocol step completes one)."""

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort an upload and free its parts."""

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        """Yield the incomplete multipart uploads under ``prefix``."""

    def bucket_versioning(self) -> str:
        """The bucket's versioning status: ``Enabled``, ``Suspended`` or ``""`` (never on)."""

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        """When an incomplete upload last received a part, and the bytes its parts hold.

        GC ages an upload by it (a long upload keeps uploading parts, and some servers report a
        fixed, fake initiation time) and reports what aborting it frees.
        Raises ObjectNotFoundError when the upload was completed or aborted meanwhile.
        """


@runtime_checkable
class RangedReadDriver(ObjectStoreDriver, Protocol):
    """An object store that also reads byte ranges of an object straight into a buffer.

    Optional: a driver without ``read_range`` works unchanged (its shards are read through
    ``open_read``). With it, a large shard is read as ranged reads in parallel, each landing
    in place in the caller's buffer and checked against the shard's block checksums.
    """

    def read_range(
        self,
        key: str,
        offset: int,
        into: BytesLike,
        *,
        version_id: str | None = None,
        if_match: str | None = None,
    ) -> ObjectInfo:
        """Fill ``into`` with bytes ``offset`` to ``offset + len(into)`` of the object.

        Every byte comes from the one object (version) ``if_match`` names: the ``etag`` that
        ``head`` returned, sent as ``If-Match`` (a generation or version where the storage
        pins by those); a replaced object raises PreconditionFailedError, a deleted one
        ObjectNotFoundError, and nothing of another object is ever written into ``into``.
        A read that breaks is resumed from the byte reached, under the same condition, up to
        the driver's attempts (TransientStorageError after them). A range past the object's
        end raises StorageError. Returns the object's info (``size``: the whole object's).
        """


@runtime_checkable
class IdentifiedStorage(Protocol):
    """A driver that says which storage it writes to, whatever its key prefix.

    Optional: what a process learns of a storage once (whether it honours conditional
    create) is kept per ``(driver type, *storage_identity)``; a driver without it is known
    by its URL, so such a fact is learnt again for every prefix.
    """

    storage_identity: tuple[str, str]
    """(endpoint, bucket): where requests go, and the bucket (container) they name."""


@runtime_checkable
class ClosableDriver(Protocol):
    """An object-store driver that holds resources (threads, a shared client's connections)
    until it is closed.

    Optional: the strategy over it closes it when closed itself (``Store.close`` ->
    ``CommitStrategy.close`` -> ``close``), and the driver may be used again afterwards,
    starting what it needs afresh. (A file-system driver's ``close`` closes a file handle.)
    """

    def close(self) -> None:
        """Release the driver's resources."""


def multipart_mode(mode: PutMode) -> PutMode:
    """``mode`` if a multipart completion may take it; InvalidInputError for an update."""
    if mode.kind == "update":
        raise InvalidInputError("a multipart completion overwrites or creates; it never updates")
    return mode


FAMILY_PROTOCOLS: dict[DriverFamily, type] = {
    DriverFamily.FILE_SYSTEM: FileSystemDriver,
    DriverFamily.OBJECT_STORE: ObjectStoreDriver,
}


def driver_family(driver: object) -> DriverFamily:
    """The family ``driver`` declares (its ``family`` class attribute); TypeError if none."""
    family = getattr(driver, "family", None)
    if not isinstance(family, DriverFamily):
        raise TypeError(
            f"{type(driver).__name__} declares no driver family: subclass FileSystemDriver or "
            f"ObjectStoreDriver (ckptstore.driver), or set family = DriverFamily.<...>"
        )
    return family


def storage_calls(driver: object) -> frozenset[str]:
    """The storage operations ``driver`` offers: the methods its driver protocols declare.

    Every protocol among the driver's classes counts, so an extension protocol (Lustre's
    layout-aware create) adds its calls; a driver that implements its family's protocol
    without subclassing it gets that protocol's calls.
    """
    protocols = [k for k in type(driver).__mro__ if Protocol in k.__bases__]
    if not protocols:
        protocols = [FAMILY_PROTOCOLS[driver_family(driver)]]
    return frozenset(
        name
        for protocol in protocols
        for name, member in vars(protocol).items()
        if inspect.isfunction(member) and not name.startswith("_")
    )
