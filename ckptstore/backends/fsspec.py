"""A generic object-store driver over any fsspec file system: ``fsspec+<protocol>://<path>``.

The protocol: docs/protocol.md §3-4; this backend: docs/backends/fsspec.md.

The commit point is the manifest created with ``pipe_file(path, data, mode="create")``, which is
an atomic create-if-absent only on the implementations listed in ``ATOMIC_CREATE`` (s3fs:
``If-None-Match: *``; gcsfs: ``ifGenerationMatch=0``; adlfs: ``upload_blob(overwrite=False)``),
and is confirmed there by the writer's conditional-create probe before its first save. Every
other implementation (fsspec's local and memory file systems among them) checks, then writes:
two writers can both publish one step. A store on one opens read-only unless the user passes
``unsafe_non_atomic_create=true``, which the conformance suite then reports as conditional
create MISSING and I5 violated.

fsspec has no compare-and-swap: LATEST is a plain overwrite, moved forward only (readers list
past the hint). Shards: on s3fs, S3 multipart uploads to attempt-unique keys (``call_s3``;
listed and aborted by GC after a crash); elsewhere, streamed through ``fs.open(key, "wb")``
(the implementation's own resumable upload or staged blocks, invisible until closed), which is
not a multipart upload another process can list: see the page for what a crash leaves.
"""

from __future__ import annotations

import contextlib
import errno
import io
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

from fsspec.spec import AbstractBufferedFile

from ckptstore.backends.error_table import naming
from ckptstore.backends.fsspec_errors import FSSPEC_RULES, translate_fsspec_errors
from ckptstore.backends.object_store import ObjectStoreBase, PutRequest
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.driver import Capability, ObjectInfo, PartInfo, UploadInfo, UploadProgress
from ckptstore.errors import (
    CapabilityError,
    InvalidInputError,
    ObjectNotFoundError,
    StoreNotFoundError,
)

if TYPE_CHECKING:
    from ckptstore.driver import Buffer, PutMode

__all__ = ["ATOMIC_CREATE", "FsspecDriver", "FsspecReadOnlyCommit"]

T = TypeVar("T")

SCHEME_PREFIX = "fsspec+"
INSTALL_HINT = "pip install 'ckptstore[fsspec]'"
ATOMIC_CREATE: Mapping[str, str] = {
    "s3fs.core.S3FileSystem": "PutObject If-None-Match: * (s3fs)",  # S3FS
    "gcsfs.core.GCSFileSystem": "upload with ifGenerationMatch=0 (gcsfs)",
    # gcsfs's default class since 2026 (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT): standard buckets
    # go to GCSFileSystem's upload; zonal buckets overwrite, which the open-time probe refuses.
    "gcsfs.extended_gcsfs.ExtendedGcsFileSystem": "upload with ifGenerationMatch=0 (gcsfs)",
    "adlfs.spec.AzureBlobFileSystem": "upload_blob(overwrite=False) (adlfs)",
}
"""Implementations whose ``pipe_file(mode="create")`` is one conditional request, by their
source: the check and the write are the storage's single operation."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
S3FS = "s3fs.core.S3FileSystem"
"""The one implementation with S3's multipart calls (``call_s3``): driven by ``S3fsDriver``."""
UNSAFE_OPTION = "unsafe_non_atomic_create"
CKPTSTORE_OPTIONS = ("part_size", "min_part_size", "concurrency", "max_attempts", UNSAFE_OPTION)
SECRET_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "account_key", "connection_string", "sas_token",
     "client_secret", "credential", "credentials", "session_token", "aws_secret_access_key"}
)  # fmt: skip
"""Storage options that hold secrets: refused in a URL, where they would end up in logs."""


def implementation_name(fs: Any) -> str:
    """``module.Class`` of a file-system instance."""
    return f"{type(fs).__module__}.{type(fs).__qualname__}"


def object_time(value: Any) -> float:
    """Seconds since the epoch of a time as implementations give it (datetime, number, ISO)."""
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return time.time()


class FsspecDriver(ObjectStoreBase):
    """Object-store primitives under one root of an fsspec file system.

    ``atomic_create``: ``pipe_file(mode="create")`` is a single conditional request on this
    implementation (or the user took the risk: ``unsafe``); without either, every write is
    refused with ``refusal``. An "upload" is one stream through ``fs.open(key, "wb")`` held by
    this process, its parts written in order (s3fs has S3's own: ``S3fsDriver``).
    """

    scheme = "fsspec"
    rules = FSSPEC_RULES
    parts_in_order = True  # an upload is one stream
    pages_listings = False  # the file system pages its listings, in pages of its own
    reads_back_creates = False
    """One request, never retried here: the commit resolves a lost answer by reading back
    (I8); an implementation may resend a request itself (s3fs on a broken connection)."""
    max_parts = 10_000
    default_min_part_size = 1
    extra_capabilities: frozenset[Capability] = frozenset()
    metadata_argument = "metadata"
    names_keep_control_characters = False
    """The name under which ``pipe_file`` and ``open`` take user metadata."""

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        url: str,
        endpoint: str = "",
        atomic_create: bool,
        unsafe: bool = False,
        min_part_size: int | None = None,
        max_attempts: int = 4,
    ) -> None:
        super().__init__(
            root.strip("/").split("/", 1)[0],
            "",
            url=url,
            endpoint=endpoint,
            max_attempts=max_attempts,
            max_delay_s=None,
            max_wait_s=2.0,
        )
        self.bucket = self.bucket_name
        self.fs = fs
        self.root = root.rstrip("/")
        self.endpoint = endpoint
        self.implementation = implementation_name(fs)
        self.atomic_create = atomic_create
        self.unsafe = unsafe and not atomic_create
        self.refusal = None if atomic_create or unsafe else _refusal(url, self.implementation)
        self.min_part_size = min_part_size or self.default_min_part_size
        capabilities = {Capability.STRONG_LIST_AFTER_WRITE}
        if atomic_create or unsafe:
            capabilities.add(Capability.CONDITIONAL_CREATE)
        self.capabilities = frozenset(capabilities | self.extra_capabilities)

    # -- plumbing ------------------------------------------------------------------------

    def _path(self, key: str, *, writing: bool = False) -> str:
        """The implementation's path of ``key``. A key with a control character, or ending in
        '/', has no object: adlfs (and Azure) store "a\\n.json" as "a.json", and fsspec's paths
        drop a final '/' (gcsfs writes "LATEST/" to "LATEST"), so a write would land on another
        key."""
        if self.names_keep_control_characters or not (_CONTROL.search(key) or key.endswith("/")):
            return f"{self.root}/{key}"
        if writing:
            raise InvalidInputError(
                f"{self.url}: {key!r}: {self.implementation} does not keep control characters, "
                f"or a final '/', in names"
            )
        raise ObjectNotFoundError(errno.ENOENT, f"{self.url}/{key!r}: no such name here")

    def _relative(self, path: str) -> str:
        stripped = self.root.lstrip("/")
        body = path.lstrip("/")
        return body[len(stripped) + 1 :] if body.startswith(stripped + "/") else body

    def where(self) -> str:
        return self.url

    def _create_once(self, what: str, key: str, call: Callable[[], T]) -> T:
        """``call()``, a conditional create of ``key``: "exists" is the refusal
        PreconditionFailedError."""
        with naming(self.url, key), translate_fsspec_errors(f"{what} {self.url}", create=True):
            return call()

    def _writable(self, what: str) -> None:
        if self.refusal is not None:
            raise CapabilityError(f"{what}: {self.refusal}")

    def _info(self, key: str, details: Mapping[str, Any]) -> ObjectInfo:
        etag = details.get("ETag") or details.get("etag") or details.get("generation")
        if not etag:  # local, memory: no ETag; size and time identify a state well enough
            etag = f"{details.get('size')}-{details.get('mtime') or details.get('created')}"
        modified = next(
            (details[k] for k in ("LastModified", "last_modified", "mtime", "updated", "created")
             if details.get(k) is not None),
            None,
        )  # fmt: skip
        return ObjectInfo(
            key=key,
            size=int(details.get("size") or details.get("Size") or 0),
            etag=str(etag),
            last_modified=object_time(modified),
            metadata=details.get("metadata") or details.get("Metadata"),
        )

    # -- the driver interface ------------------------------------------------------------

    def check_bucket(self) -> None:
        if not self.bucket or self.root.startswith("/"):
            return  # a local or memory root has no bucket: its directories come with writes
        try:  # first: exists() answers False (gcsfs) or True with a warning (adlfs) on denial
            self.retried(f"info {self.root}", lambda: self.fs.info(self.root))
        except ObjectNotFoundError:
            pass  # an empty store, or no bucket: exists() tells
        self._bucket_found(self.retried(f"checking {self.bucket}",
                                         lambda: bool(self.fs.exists(self.bucket))))  # fmt: skip

    def _bucket_found(self, found: bool) -> None:
        if not found:
            raise StoreNotFoundError(
                f"{self.url}: {self.bucket!r} does not exist (ckptstore never creates buckets, "
                f"containers or root directories; create it, or check the name and endpoint)"
            )

    def put_request(
        self, key: str, body: bytes, mode: PutMode, metadata: Mapping[str, str] | None
    ) -> PutRequest:
        what = f"writing {key}"
        self._writable(what)
        if mode.kind == "update":
            raise CapabilityError(
                f"{self.url}: fsspec has no compare-and-swap (If-Match); {key} cannot be "
                f"updated conditionally"
            )
        kwargs = {self.metadata_argument: dict(metadata)} if metadata else {}
        path = self._path(key, writing=True)
        if mode.kind == "create":
            # Never open(path, "xb"): s3fs writes a 0-byte "xb" file with a plain PutObject
            # that overwrites.
            return PutRequest(
                f"{what} (create)",
                lambda: self._written(key, body, self._create_once(
                    f"{what} (create)", key,
                    lambda: self.fs.pipe_file(path, body, mode="create", **kwargs),
                )),
            )  # fmt: skip
        return PutRequest(
            what, lambda: self._written(key, body, self.fs.pipe_file(path, body, **kwargs))
        )

    def _written(self, key: str, body: bytes, written: Any) -> ObjectInfo:
        """What a write made, from its answer (s3fs, adlfs) or a HEAD after it."""
        if isinstance(written, Mapping) and (written.get("ETag") or written.get("etag")):
            return self._info(key, {**written, "size": len(body)})  # s3fs, adlfs: no HEAD
        try:
            return self.head(key)
        except ObjectNotFoundError:  # deleted meanwhile: what we wrote is still what we know
            return ObjectInfo(key, len(body), "", time.time())

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        self._no_versions(version_id)
        with self.open_read(key) as stream:
            data = stream.read()
            details = getattr(stream, "details", None)
        if isinstance(details, Mapping):
            return data, self._info(key, {**details, "size": len(data)})
        return data, ObjectInfo(key, len(data), "", time.time())

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        self._no_versions(version_id)
        path = self._path(key)
        what = f"reading {key}"
        handle = self.retried(what, lambda: self.fs.open(path, "rb"), key=key)
        details = getattr(handle, "details", None)
        if isinstance(details, Mapping) and (
            details.get("type") == "directory" or details.get("size") is None
        ):  # adlfs opens a prefix (keys below it, no object) as a file of no size
            handle.close()
            raise ObjectNotFoundError(
                errno.ENOENT, f"{self.url}/{key}: a directory, no object", url=self.url, key=key
            )
        return cast(BinaryIO, _TranslatingReader(handle, f"{what} {self.url}", self.url, key))

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        self._no_versions(version_id)
        path = self._path(key)
        details = self.retried(f"info {key}", lambda: self.fs.info(path), key=key)
        if details.get("type") == "directory":
            if key.endswith("/"):  # gcsfs and adlfs show a marker object "x/" as a directory
                return ObjectInfo(key, 0, "", object_time(details.get("updated")))
            raise ObjectNotFoundError(
                errno.ENOENT, f"{self.url}/{key}: a directory, no object", url=self.url, key=key
            )
        return self._info(key, details)

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        self._writable(f"deleting {key}")
        self._no_versions(version_id)
        path = self._path(key)
        try:
            self.retried(f"deleting {key}", lambda: self.fs.rm_file(path), key=key)
        except ObjectNotFoundError:
            return  # already gone: a delete is idempotent, as on S3

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` in key order: one recursive ``find`` of the deepest
        directory the prefix names, filtered (a listing, trusted only to say what to look at)."""
        directory = prefix.rpartition("/")[0]
        base = self._path(directory) if directory else self.root
        found = self.retried(
            f"listing {prefix or '/'}", lambda: self.fs.find(base, detail=True, withdirs=False)
        )
        infos = []
        for path, details in found.items():
            if details.get("type") == "directory":
                continue
            key = self._relative(path)
            if not details.get("size") and not self._is_object(key):
                key += "/"  # a marker "x/" listed as "x" (adlfs): never take it for "x"
            if key.startswith(prefix) and (start_after is None or key > start_after):
                infos.append(self._info(key, details))
        yield from sorted(infos, key=lambda info: info.key)

    def _is_object(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        yield from self.list(prefix)  # no versions: each object is its only version

    @staticmethod
    def _no_versions(version_id: str | None) -> None:
        if version_id is not None:
            raise InvalidInputError("fsspec+ stores keep no object versions to read or delete")

    # -- uploads: one stream through fs.open(key, "wb") per shard, held by this process -----

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        self._writable(f"uploading {key}")
        path = self._path(key, writing=True)
        kwargs = {self.metadata_argument: dict(metadata)} if metadata else {}
        handle = self.once(
            f"opening {key} for writing", lambda: self.fs.open(path, "wb", **kwargs), key=key
        )
        if isinstance(handle, AbstractBufferedFile):
            handle._unclosable = True  # noqa: SLF001  only complete_multipart commits it
        stream = _Stream(self._where(path), handle, time.time())
        with _STREAMS_LOCK:
            _STREAMS[stream.upload_id] = stream
        return stream.upload_id

    def _where(self, path: str) -> str:
        """A stream's place among this process's streams: implementation, endpoint, path."""
        return f"{self.implementation}|{self.endpoint}|{path}"

    def _stream(self, key: str, upload_id: str) -> _Stream:
        with _STREAMS_LOCK:
            stream = _STREAMS.get(upload_id)
        if stream is None or stream.where != self._where(self._path(key)):
            raise ObjectNotFoundError(
                errno.ENOENT,
                f"{self.url}/{key}: no upload {upload_id} in this process",
                url=self.url,
                key=key,
            )
        return stream

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        stream = self._stream(key, upload_id)
        with stream.lock:
            if part_number != stream.parts + 1:
                raise InvalidInputError(
                    f"{self.url}/{key}: part {part_number} out of order (a stream takes its "
                    f"parts one after another; the next is {stream.parts + 1})"
                )
            self.once(
                f"writing {key} part {part_number}", lambda: stream.handle.write(data), key=key
            )
            stream.parts += 1
            stream.size += len(data)
            stream.last_activity = time.time()
        return PartInfo(part_number, f"stream-{part_number}", len(data))

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        if create:
            raise CapabilityError(
                f"{self.url}: a streamed write through fsspec cannot be completed "
                f"conditionally (no conditional multipart completion)"
            )
        stream = self._stream(key, upload_id)
        if [p.part_number for p in parts] != list(range(1, stream.parts + 1)):
            raise InvalidInputError(f"{self.url}/{key}: the parts are not the ones written")
        with _STREAMS_LOCK:
            _STREAMS.pop(upload_id, None)
        stream.handle._unclosable = False  # noqa: SLF001
        self.once(f"closing {key}", stream.handle.close, key=key)
        return self.head(key)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        stream = self._stream(key, upload_id)
        with _STREAMS_LOCK:
            _STREAMS.pop(upload_id, None)
        self.once(f"abandoning the write of {key}", lambda: _discard(self.fs, stream), key=key)

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        # a prefix, not a key: it may end in '/' (which no key may)
        start, root = self._where(f"{self.root}/{prefix}"), self._where(self._path(""))
        with _STREAMS_LOCK:
            mine = [stream for stream in _STREAMS.values() if stream.where.startswith(start)]
        for stream in sorted(mine, key=lambda stream: stream.where):
            yield UploadInfo(stream.where[len(root) :], stream.upload_id, stream.started)

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        stream = self._stream(upload.key, upload.upload_id)
        return UploadProgress(stream.last_activity, stream.size, stream.parts)


class _Stream:
    """One shard being streamed through ``fs.open(key, "wb")`` by this process: an "upload"
    that every driver of the process over the same storage sees (GC after a writer failed)."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, where: str, handle: Any, started: float) -> None:
        with _STREAMS_LOCK:
            self.upload_id = f"stream-{next(self._ids)}-{id(handle):x}"
        self.where = where
        self.handle = handle
        self.started = started
        self.last_activity = started
        self.parts = 0
        self.size = 0
        self.lock = threading.Lock()


_STREAMS: dict[str, _Stream] = {}
_STREAMS_LOCK = threading.Lock()


def _discard(fs: Any, stream: _Stream) -> None:
    """Abandon a stream without publishing its bytes: a buffered file's ``discard`` (an aborted
    upload, dropped blocks), never its close (which would commit them); a file written in place
    (local) is closed and removed."""
    handle = stream.handle
    if isinstance(handle, AbstractBufferedFile):
        handle._unclosable = False  # noqa: SLF001
        handle.discard()
        handle.closed = True  # never committed, not even by its __del__
        return
    handle.close()
    path = getattr(handle, "path", None)
    if path:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass


class _TranslatingReader(io.RawIOBase):
    """An fsspec file opened for reading, whose errors are ckptstore's."""

    def __init__(self, handle: Any, what: str, url: str, key: str) -> None:
        super().__init__()
        self._handle = handle
        self._what = what
        self._url, self._key = url, key
        self.details = getattr(handle, "details", None)

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        with naming(self._url, self._key), translate_fsspec_errors(self._what):
            yield

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._handle.seekable())

    def read(self, size: int | None = -1) -> bytes:
        with self._translated():
            return bytes(self._handle.read(-1 if size is None else size))

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        with self._translated():
            data = self._handle.read(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        with self._translated():
            return int(self._handle.seek(position, whence))

    def tell(self) -> int:
        return int(self._handle.tell())

    def close(self) -> None:
        if not self.closed:
            try:
                self._handle.close()
            finally:
                super().close()


class FsspecReadOnlyCommit(ConditionalPutCommit):
    """The conditional-put protocol on an fsspec implementation whose create is not atomic:
    readers work; every write (a save's first step, a delete, GC) is refused with the reason."""

    def check_capabilities(self) -> None:
        return  # reading needs no conditional create; writing is refused by the driver

    def ensure_conditional_create(self) -> None:
        refusal = getattr(self.driver, "refusal", None)
        if refusal is not None:
            raise CapabilityError(refusal)
        super().ensure_conditional_create()


def _refusal(url: str, implementation: str) -> str:
    return (
        f"{url} is read-only: {implementation}'s pipe_file(mode='create') checks whether the "
        f"key exists and then writes, which is not atomic, so two writers can both publish "
        f"one step (invariant I5). ckptstore writes only where create-if-absent is one "
        f"conditional request ({', '.join(sorted(ATOMIC_CREATE))}). To write anyway, "
        f"knowing that concurrent writers can overwrite each other's checkpoints, pass "
        f"{UNSAFE_OPTION}=true"
    )
