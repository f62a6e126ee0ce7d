"""Google Cloud Storage driver on google-cloud-storage: ``gs://bucket/prefix`` (committed by a
conditional put) and ``gs+versioned://bucket/prefix`` (manifests pin generations).

The protocol: docs/protocol.md §3-4; this backend: docs/backends/gcs.md.

An object's ETag, to ckptstore, is its generation: a create is ``ifGenerationMatch=0`` and a
compare-and-swap ``ifGenerationMatch=<generation>``, each on a single-request (multipart/
related) upload, the one upload kind on which fake-gcs-server honours preconditions as GCS
does. A version id is a generation too: GCS keeps every generation of a versioned bucket
readable by number.

Multipart uploads are composite objects. Each part is a piece object, uploaded in parallel,
with its CRC32C sent for the server to check; completion composes the pieces (in a tree of
at most 32 sources per call) into the target and then deletes them. The pieces live under
the store's private ``.ckptstore-uploads/`` prefix, which ``list`` never shows; their names
carry the target key and the upload id, so every piece, even one left by a crash at any
instant, is found by ``list_multipart_uploads`` and removed by ``abort_multipart`` (GC).

Idempotent calls are retried on transient errors with bounded exponential backoff and jitter
(tenacity); conditional writes never are blindly: a create whose outcome is unknown is
resolved by reading the key back, and a compare-and-swap's surfaces as
``IndeterminateOutcomeError`` for the protocol to read back (I8).
"""

from __future__ import annotations

import errno
import logging
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast
from urllib.parse import quote

from google.api_core import exceptions as api_exceptions

from ckptstore.backends.gcs_errors import GCS_RULES
from ckptstore.backends.moved import served_from
from ckptstore.backends.object_store import S3_LIKE, Holder, ObjectStoreBase, PutRequest
from ckptstore.backends.range_reader import RangeReader, ReadAhead
from ckptstore.backends.wire_format import crc32c_b64, timestamp
from ckptstore.driver import Capability, ObjectInfo, PartInfo, UploadInfo, UploadProgress
from ckptstore.errors import (
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ckptstore.backends.gcs_open import URL_OPTIONS as URL_OPTIONS
    from ckptstore.backends.gcs_open import make_client as make_client
    from ckptstore.backends.gcs_open import make_transport as make_transport
    from ckptstore.backends.gcs_open import open_gcs as open_gcs
    from ckptstore.backends.gcs_open import open_gcs_versioned as open_gcs_versioned
    from ckptstore.backends.gcs_open import parse_location as parse_location
    from ckptstore.backends.object_store import DriverSettings
    from ckptstore.driver import Buffer, PutMode

__all__ = ["UPLOADS", "GCSDriver", "open_gcs", "open_gcs_versioned"]

log = logging.getLogger(__name__)
T = TypeVar("T")

UPLOADS = ".ckptstore-uploads/"
"""Where, under the store's prefix, the pieces of incomplete composite uploads live:
``.ckptstore-uploads/<key>/<upload id>.<what>``, ``<what>`` being ``init`` (made when the
upload starts), ``p<part>`` (a part) or ``t<level>-<n>`` (an intermediate composite)."""
UPLOAD_METADATA = "ckptstore-composed-from"
"""Metadata of a composed object: the upload it completed. Lets a listing tell the leftover
pieces of a completed upload (a crash between compose and cleanup) from a live upload."""
COMPOSE_SOURCES = 32
"""GCS composes at most 32 source objects per call."""
GCS_MAX_COMPONENTS = 1024
"""A composite object has at most 1024 components: the most parts an upload can have."""
SINGLE_REQUEST_LIMIT = 8 * 1024 * 1024
"""google-cloud-storage uploads up to 8 MiB in one multipart/related request and larger data
as a resumable upload (two requests or more)."""
READ_WINDOW = 8 * 1024 * 1024
"""A stream reads ahead in ranged GETs of this size, several at once."""
_MARKER_VERSION = "deleted:"
"""Version ids of the synthetic delete markers (see ``list_versions``)."""


def _generation(etag: str) -> int:
    """The generation an ETag (``"<generation>"``, quoted or not) names."""
    bare = etag.strip('"')
    if not bare.isdigit():
        raise PreconditionFailedError(
            f"{etag!r} is not a GCS generation: nothing can match it", http_status=412
        )
    return int(bare)


class GCSDriver(ObjectStoreBase):
    """Object-store primitives on one GCS bucket under a prefix, through google-cloud-storage."""

    scheme = "gs"
    rules = GCS_RULES
    store_hint = "create it, or check the name, project and endpoint"
    reader_threads = "ckptstore-gcs-read"
    max_parts = GCS_MAX_COMPONENTS

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        timeout: tuple[float, float] = (5.0, 60.0),
        versioned: bool = False,
        http: Any = None,
        **settings: Unpack[DriverSettings],
    ) -> None:
        endpoint = str(getattr(client, "api_endpoint", "") or "")
        super().__init__(bucket, prefix, endpoint=endpoint, **settings)
        self.bucket = bucket
        self.client = client
        self.http = http
        """The authorized requests session the client uses, for ranged reads (None: the
        client's own downloads)."""
        self._bucket = client.bucket(bucket)
        self.timeout = timeout
        self.versioned = versioned
        self._uploads = self.prefix + UPLOADS
        self._metadata: dict[str, Mapping[str, str]] = {}
        self._read_ahead = ReadAhead(READ_WINDOW, self.read_concurrency, self.executor)
        self.capabilities = S3_LIKE | {Capability.VERSIONING} if versioned else S3_LIKE

    # -- plumbing ------------------------------------------------------------------------

    def _blob(self, full: str, generation: int | None = None) -> Any:
        return self._bucket.blob(full, generation=generation)

    def _info(self, key: str, blob: Any, *, metadata: bool = True) -> ObjectInfo:
        live = blob.time_deleted is None
        return ObjectInfo(
            key=key,
            size=int(blob.size or 0),
            etag=f'"{blob.generation}"',
            last_modified=timestamp(blob.updated),
            version_id=str(blob.generation) if self.versioned else None,
            is_latest=live,
            metadata=_user_metadata(blob.metadata) if metadata else None,
        )

    def _version(self, version_id: str | None) -> int | None:
        if version_id is None:
            return None
        if version_id.startswith(_MARKER_VERSION) or not version_id.isdigit():
            raise ObjectNotFoundError(errno.ENOENT, f"{version_id!r}: no such object version")
        return int(version_id)

    # -- the driver interface ------------------------------------------------------------

    def probe_bucket(self) -> tuple[str, Callable[[], object]]:
        return "buckets.get", lambda: self._bucket.reload(timeout=self.timeout, retry=None)

    def put_request(
        self, key: str, body: bytes, mode: PutMode, metadata: Mapping[str, str] | None
    ) -> PutRequest:
        if mode.conditional and len(body) > SINGLE_REQUEST_LIMIT:
            # A larger upload is resumable, and fake-gcs-server ignores its preconditions.
            raise InvalidInputError(
                f"{self.url}/{key}: a conditional put takes at most {SINGLE_REQUEST_LIMIT} "
                f"bytes (one request), not {len(body)}"
            )
        condition = None if mode.kind == "overwrite" else 0
        if mode.kind == "update":
            condition = _generation(mode.etag or "")
        what = f"upload {key}" + ("" if condition is None else f" (ifGenerationMatch={condition})")
        return PutRequest(
            what, lambda: self._info(key, self._upload(self.full(key), body, metadata, condition))
        )

    def _upload(
        self,
        full: str,
        body: bytes,
        metadata: Mapping[str, str] | None,
        condition: int | None,
        checksum: str | None = None,
    ) -> Any:
        """Upload ``body`` as ``full``; with checksums on, its CRC32C (``checksum`` if the
        caller computed it) goes in the upload's metadata, and the server checks it."""
        blob = self._blob(full)
        if metadata:
            blob.metadata = dict(metadata)
        if self.checksums:
            blob.crc32c = checksum or crc32c_b64(body)
        blob.upload_from_string(
            body,
            content_type="application/octet-stream",
            if_generation_match=condition,
            checksum=None,
            retry=None,
            timeout=self.timeout,
        )
        return blob

    def _stat(self, full: str, generation: int | None) -> Any:
        blob = self._blob(full, generation)
        self.retried(
            f"objects.get {full}",
            lambda: blob.reload(timeout=self.timeout, retry=None),
            key=self.relative(full),
        )
        return blob

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        return self._info(key, self._stat(self.full(key), self._version(version_id)))

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        with self._open(key, version_id) as stream:
            return stream.read(), stream.info

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        """A seekable stream of one generation of the object, read ahead in parallel ranged
        GETs (callers check the bytes end to end: a shard's CRC32C, a manifest's checksum)."""
        return cast(BinaryIO, self._open(key, version_id))

    def _open(self, key: str, version_id: str | None) -> RangeReader:
        blob = self._stat(self.full(key), self._version(version_id))
        generation = int(blob.generation)

        def fetch(offset: int, length: int) -> bytes | bytearray:
            """Bytes of one generation; a replaced object is ObjectNotFoundError."""
            what = f"download {blob.name} bytes {offset}-{offset + length - 1}"
            return self.retried(
                what,
                lambda: self._download(blob.name, generation, offset, offset + length),
                key=key,
            )

        return RangeReader(
            self._info(key, blob),
            fetch,
            pin=f"gs://{self.bucket}/{blob.name}#{generation}",
            ahead=self._read_ahead,
        )

    def _download(self, name: str, generation: int, start: int, end: int) -> bytes | bytearray:
        """One ranged GET of a generation, read straight into a buffer in large reads.

        The client's own download reads the body 8 KiB at a time through a BytesIO, which
        costs more CPU than the transfer on a fast link; the request is the same JSON API
        media download (``alt=media&generation=``), on the client's own authorized session.
        """
        if self.http is None:
            data: bytes = self._blob(name, generation).download_as_bytes(
                start=start, end=end - 1, raw_download=True, checksum=None, retry=None,
                timeout=self.timeout,
            )  # fmt: skip
            return data
        url = (
            f"{self.client.api_endpoint}/download/storage/v1/b/{quote(self.bucket, safe='')}"
            f"/o/{quote(name, safe='')}"
        )
        response = self.http.get(
            url,
            params={"alt": "media", "generation": str(generation)},
            headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"},
            stream=True,
            timeout=self.timeout,
        )
        with response:
            if response.status_code not in (200, 206):
                raise api_exceptions.from_http_response(response)  # type: ignore[no-untyped-call]
            if response.status_code == 200 and start != 0:
                raise StorageError(errno.EIO, f"GET {name}: the server ignored the Range")
            buffer = bytearray(end - start)
            view = memoryview(buffer)
            got = 0
            while got < len(buffer):
                count = response.raw.readinto(view[got:])
                if not count:
                    break
                got += count
            return buffer if got == len(buffer) else buffer[:got]

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        if version_id is not None and version_id.startswith(_MARKER_VERSION):
            return  # a synthetic delete marker: there is nothing stored to delete
        generation = self._version(version_id)
        full = self.full(key)
        if generation is not None and self.versioned and not self.exact_generation_deletes():
            try:
                live = int(self._stat(full, None).generation)
            except ObjectNotFoundError:
                live = None
            if live != generation:  # this server would delete the live object instead
                log.debug("%s: %s@%d stays: the server cannot delete a noncurrent "
                            "generation", self.url, key, generation)  # fmt: skip
                return
        self._delete_full(full, generation)

    def exact_generation_deletes(self) -> bool:
        """Whether deleting a noncurrent generation by number deletes that generation, as
        GCS does (measured once per bucket). fake-gcs-server (1.54) ignores the number, and
        ``ifGenerationMatch`` on a delete, and archives the live object instead: there a
        noncurrent generation is left alone, and a live one is archived, never lost."""
        identity = (str(self.client.api_endpoint), self.bucket)
        with _exact_deletes_lock:
            if identity not in _exact_deletes:
                _exact_deletes[identity] = self._measure_generation_deletes()
            return _exact_deletes[identity]

    def _measure_generation_deletes(self) -> bool:
        probe = f"{self._uploads}.probe-deletes-{secrets.token_hex(6)}"  # hidden from list
        first = self.retried(f"upload {probe}", lambda: self._upload(probe, b"1", None, None))
        second = self.retried(f"upload {probe}", lambda: self._upload(probe, b"2", None, None))
        self._delete_full(probe, int(first.generation))
        try:
            exact = int(self._stat(probe, None).generation) == int(second.generation)
        except ObjectNotFoundError:
            exact = False
        self._delete_full(probe, int(second.generation))
        if not exact:
            log.warning("%s: the server deletes the live object when asked to delete a "
                        "noncurrent generation (fake-gcs-server does): old generations will "
                        "not be freed", self.url)  # fmt: skip
        return exact

    def _delete_full(self, full: str, generation: int | None) -> None:
        blob = self._blob(full, generation)
        try:
            self.retried(
                f"objects.delete {full}",
                lambda: blob.delete(timeout=self.timeout, retry=None),
                key=self.relative(full),
            )
        except ObjectNotFoundError:
            return  # deleting what is gone is not an error (S3's semantics)

    def _pages(self, what: str, **args: Any) -> Iterator[Any]:
        """Every object a listing yields, each page request retried on its own."""

        def page(token: str | None) -> tuple[list[Any], str | None]:
            sized = {"page_size": self.list_page_size} if self.list_page_size else {}
            listing = self.client.list_blobs(
                self._bucket, page_token=token, retry=None, timeout=self.timeout, **args, **sized
            )
            return list(next(listing.pages)), listing.next_page_token or None

        return self.pages(what, page)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        args: dict[str, Any] = {"prefix": self.full(prefix)}
        if start_after is not None:
            args["start_offset"] = self.full(start_after)  # inclusive: the equal key is skipped
        for blob in self._pages(f"objects.list {prefix}", **args):
            if blob.name.startswith(self._uploads):
                continue  # pieces of composite uploads: never checkpoint data
            if start_after is not None and blob.name <= self.full(start_after):
                continue
            yield self._info(self.relative(blob.name), blob, metadata=False)

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every generation under ``prefix``, and a synthetic delete marker over each key that
        has generations but no live one.

        GCS has no delete markers: deleting a versioned object makes its live generation
        noncurrent. The marker stands for that state as S3 shows it (is_latest, stamped with
        the deletion time); deleting it deletes nothing.
        """
        # ``versions="true"``, not True: the client would send ``versions=True``, which
        # fake-gcs-server ignores (GCS takes both); the JSON API's spelling is lowercase.
        versions: dict[str, list[Any]] = {}
        for blob in self._pages(f"objects.list {prefix} (versions)", prefix=self.full(prefix),
                                versions="true"):  # fmt: skip
            if not blob.name.startswith(self._uploads):
                versions.setdefault(blob.name, []).append(blob)
        for full in sorted(versions):
            key = self.relative(full)
            blobs = sorted(versions[full], key=lambda b: int(b.generation))
            for blob in blobs:
                yield self._info(key, blob, metadata=False)
            if all(blob.time_deleted is not None for blob in blobs):
                deleted = max(timestamp(blob.time_deleted) for blob in blobs)
                yield ObjectInfo(
                    key=key,
                    size=0,
                    etag="",
                    last_modified=deleted,
                    version_id=f"{_MARKER_VERSION}{blobs[-1].generation}",
                    is_delete_marker=True,
                    is_latest=True,
                )

    def bucket_versioning(self) -> str:
        """``Enabled`` or ``""``; on a versioned bucket, also whether one generation can be
        deleted by number (``Capability.VERSION_DELETE``), measured once per bucket."""
        self.retried("buckets.get", lambda: self._bucket.reload(timeout=self.timeout, retry=None))
        if not self._bucket.versioning_enabled:
            return ""
        if self.versioned and self.exact_generation_deletes():
            # Measured, not assumed: an emulator may not delete one generation (see there).
            self.capabilities = self.capabilities | {Capability.VERSION_DELETE}
        return "Enabled"

    # -- composite uploads ---------------------------------------------------------------

    def _piece(self, key: str, upload_id: str, what: str) -> str:
        return f"{self._uploads}{key}/{upload_id}.{what}"

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        if not key or key.startswith(UPLOADS):
            raise InvalidInputError(f"{key!r}: not a key an upload can complete to")
        upload_id = secrets.token_hex(10)
        marker = self._piece(key, upload_id, "init")
        self.retried(
            f"upload {marker}", lambda: self._upload(marker, b"", metadata, None), key=key
        )  # its user metadata is the object's, read at completion
        if metadata:
            self._metadata[upload_id] = dict(metadata)
        return upload_id

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        if not 1 <= part_number <= self.max_parts:
            raise InvalidInputError(f"part number {part_number} is not in 1..{self.max_parts}")
        body = bytes(data)  # no copy of the bytes parts arrive as
        checksum = crc32c_b64(body) if self.checksums else None  # once: sent and recorded
        piece = self._piece(key, upload_id, f"p{part_number:05d}")
        blob = self.retried(
            f"upload {piece}", lambda: self._upload(piece, body, None, None, checksum), key=key
        )
        try:  # after the piece: an abort that raced it is seen, and its piece removed
            self._stat(self._piece(key, upload_id, "init"), None)
        except ObjectNotFoundError as exc:
            self._delete_full(piece, int(blob.generation))
            raise ObjectNotFoundError(
                errno.ENOENT,
                f"{self.url}/{key}: no upload {upload_id} (aborted?)",
                url=self.url,
                key=key,
            ) from exc
        return PartInfo(part_number, f'"{blob.generation}"', len(body), checksum)

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        """Compose the pieces into ``key`` (a tree of 32-source composes), then delete them.

        Each source is pinned by its generation, so the object is exactly the parts listed.
        With ``PutMode.CREATE`` the final compose carries ``ifGenerationMatch=0`` (GCS
        honours it; fake-gcs-server does not: ckptstore never relies on it).
        """
        numbers = [part.part_number for part in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise InvalidInputError(f"{key}: parts must be listed once each, in order")
        if len(parts) > self.max_parts:
            raise InvalidInputError(f"{key}: more than {self.max_parts} parts")
        metadata = dict(self._upload_metadata(key, upload_id))
        metadata[UPLOAD_METADATA] = upload_id
        sources = [
            (self._piece(key, upload_id, f"p{part.part_number:05d}"), _generation(part.etag))
            for part in parts
        ]
        level = 0
        while len(sources) > COMPOSE_SOURCES:
            level += 1
            groups = [
                (
                    self._piece(key, upload_id, f"t{level}-{n:03d}"),
                    sources[at : at + COMPOSE_SOURCES],
                )
                for n, at in enumerate(range(0, len(sources), COMPOSE_SOURCES))
            ]
            composed = self.each(
                lambda group: self._compose(group[0], group[1], None, None), groups
            )
            sources = [
                (name, int(blob.generation))
                for (name, _), blob in zip(groups, composed, strict=True)
            ]
        blob = self._compose_target(key, upload_id, sources, metadata, create)
        self._remove_pieces(key, upload_id)
        self._metadata.pop(upload_id, None)
        return self._info(key, blob)

    def _upload_metadata(self, key: str, upload_id: str) -> Mapping[str, str]:
        if upload_id in self._metadata:
            return self._metadata[upload_id]
        marker = self._stat(self._piece(key, upload_id, "init"), None)  # another process's
        return _user_metadata(marker.metadata) or {}

    def _compose(
        self,
        full: str,
        sources: Sequence[tuple[str, int]],
        metadata: Mapping[str, str] | None,
        condition: int | None,
    ) -> Any:
        """One compose call; retried unless conditional (composing the same pinned sources
        again makes the same object)."""
        blob = self._blob(full)
        blob.content_type = "application/octet-stream"
        if metadata:
            blob.metadata = dict(metadata)
        pieces = [self._blob(name) for name, _ in sources]

        def call() -> Any:
            blob.compose(
                pieces,
                if_generation_match=condition,
                if_source_generation_match=[generation for _, generation in sources],
                retry=None,
                timeout=self.timeout,
            )
            return blob

        what = f"objects.compose {full} ({len(sources)} sources)"
        if condition is None:
            return self.retried(what, call)
        return self.once(what, call)

    def _compose_target(
        self,
        key: str,
        upload_id: str,
        sources: Sequence[tuple[str, int]],
        metadata: Mapping[str, str],
        create: bool,
    ) -> Any:
        full = self.full(key)
        if self.versioned and not create:
            # fake-gcs-server (1.54) composing over a live object of a versioned bucket keeps
            # the old bytes under the new generation, losing the generation a manifest pins.
            # Archiving the live generation first (a delete keeps it on a versioned bucket)
            # costs one request on GCS, which does not need it.
            self._delete_full(full, None)
        if not create or self.raw_conditionals:
            return self._compose(full, sources, metadata, 0 if create else None)

        def read_back() -> Any:  # the upload id in the object's metadata says whose it is
            try:
                blob = self._stat(full, None)
            except ObjectNotFoundError:
                return Holder.NOBODY
            if (blob.metadata or {}).get(UPLOAD_METADATA) != upload_id:
                return Holder.ANOTHER_WRITER
            return blob

        return self.resolve_create(
            f"compose {key} (ifGenerationMatch=0)",
            lambda: self._compose(full, sources, metadata, 0),
            read_back,
        )

    def _remove_pieces(self, key: str, upload_id: str) -> int:
        """Delete every piece of an upload, the ``init`` marker last; return the bytes freed."""
        pieces = list(self._pages(f"objects.list {key} pieces",
                                  prefix=self._piece(key, upload_id, "")))  # fmt: skip
        markers = [blob for blob in pieces if blob.name.endswith(".init")]
        parts = [blob for blob in pieces if not blob.name.endswith(".init")]
        # One request per piece, at once (33 one after another cost a second on GCS per
        # 256 MiB shard); the marker only once every part is gone.
        self.each(lambda blob: self._delete_full(blob.name, int(blob.generation)), parts)
        for blob in markers:
            self._delete_full(blob.name, int(blob.generation))
        return sum(int(blob.size or 0) for blob in pieces)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._remove_pieces(key, upload_id)
        self._metadata.pop(upload_id, None)

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        """Every upload with a piece under ``prefix`` (its ``init`` marker or not: a crash
        in an abort leaves parts without one). An upload whose target was composed from it
        is not incomplete but uncleaned (a crash after the compose): its pieces are deleted
        here instead of being reported."""
        found: dict[tuple[str, str], list[Any]] = {}
        for blob in self._pages(f"objects.list {UPLOADS}{prefix}",
                                prefix=self._uploads + prefix):  # fmt: skip
            where, _, name = blob.name[len(self._uploads) :].rpartition("/")
            upload_id = name.partition(".")[0]
            if where and upload_id:
                found.setdefault((where, upload_id), []).append(blob)
        for (key, upload_id), pieces in sorted(found.items()):
            if self._completed(key, upload_id):
                log.info("%s/%s: removing the pieces of completed upload %s", self.url, key,
                         upload_id)  # fmt: skip
                self._remove_pieces(key, upload_id)
                continue
            yield UploadInfo(
                key=key,
                upload_id=upload_id,
                initiated=min(timestamp(blob.time_created) for blob in pieces),
            )

    def _completed(self, key: str, upload_id: str) -> bool:
        try:
            blob = self._stat(self.full(key), None)
        except ObjectNotFoundError:
            return False
        return bool((blob.metadata or {}).get(UPLOAD_METADATA) == upload_id)

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        where = self._piece(upload.key, upload.upload_id, "")
        pieces = list(self._pages(f"objects.list {upload.key} pieces", prefix=where))
        if not pieces:
            raise ObjectNotFoundError(
                errno.ENOENT, f"{self.url}/{upload.key}: upload {upload.upload_id} is gone"
            )
        parts = [blob for blob in pieces if blob.name.rpartition(".")[2].startswith("p")]
        return UploadProgress(
            last_activity=max(timestamp(blob.updated) for blob in pieces),
            size=sum(int(blob.size or 0) for blob in pieces),
            parts=len(parts),
        )


def _user_metadata(metadata: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """The object's user metadata without the driver's own entries."""
    if not metadata:
        return {} if metadata is not None else None
    return {k: v for k, v in metadata.items() if k != UPLOAD_METADATA}


_exact_deletes: dict[tuple[str, str], bool] = {}
_exact_deletes_lock = threading.Lock()


__getattr__ = served_from(__name__, "ckptstore.backends.gcs_open")
"""``gcs_open``'s names (``open_*``, ``make_client``, ...), still served from here."""
