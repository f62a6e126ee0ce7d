"""Azure Blob Storage driver on azure-storage-blob: ``az://container/prefix``, committed by a
conditional put.

The protocol: docs/protocol.md §3-4; this backend: docs/backends/azure.md.

Shards go to attempt-unique block blobs: small ones as one Put Blob, large ones as blocks staged
concurrently (Put Block) and committed (Put Block List); the manifest is created with
``If-None-Match: *`` and LATEST moved with ``If-Match``. Azure has no multipart upload object:
an "upload" is the uncommitted blocks of one blob whose block ids name it (upload id, part
number, and when the block was staged on the storage's clock), so that GC can list dead
uploads, age them by their newest block, and free them. Idempotent calls are retried on
transient errors with bounded exponential backoff and jitter (tenacity; the SDK's own retries
are off); conditional writes are never retried blindly: a create whose outcome is unknown is
resolved by reading the key back. Streams of large blobs fetch ranges ahead in parallel, each
pinned to the first answer's ETag; ``read_range`` (``RangedReadDriver``) reads a range straight
into the caller's buffer, pinned by ``If-Match``, resuming from the byte reached when its body
breaks.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import http.client
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

import urllib3
from azure.core import MatchConditions
from azure.core.exceptions import AzureError, HttpResponseError
from azure.storage.blob import BlobBlock, ContainerClient

from ckptstore.backends.azure_errors import AZURE_RULES
from ckptstore.backends.error_table import first_line, naming
from ckptstore.backends.moved import served_from
from ckptstore.backends.object_store import S3_LIKE, Holder, ObjectStoreBase, PutRequest
from ckptstore.backends.range_reader import RangeReader, ReadAhead
from ckptstore.backends.wire_format import timestamp
from ckptstore.driver import (
    Capability,
    ObjectInfo,
    PartInfo,
    RangedReadDriver,
    UploadInfo,
    UploadProgress,
)
from ckptstore.errors import (
    CkptStoreError,
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ckptstore.backends.azure_open import CREDENTIAL_OPTIONS as CREDENTIAL_OPTIONS
    from ckptstore.backends.azure_open import URL_OPTIONS as URL_OPTIONS
    from ckptstore.backends.azure_open import make_client as make_client
    from ckptstore.backends.azure_open import open_azure as open_azure
    from ckptstore.backends.azure_open import parse_location as parse_location
    from ckptstore.backends.object_store import DriverSettings
    from ckptstore.driver import Buffer, BytesLike, PutMode

__all__ = [
    "READ_PIECE",
    "AzureBlobDriver",
    "RangeAnswer",
    "ServerClock",
    "decode_metadata",
    "direct_body_reads",
    "encode_metadata",
    "open_azure",
    "parse_location",
]

log = logging.getLogger(__name__)


AZURE_MAX_BLOCKS = 50_000
READ_PIECE = 8 * 1024 * 1024
"""Bytes per ranged GET of a large blob; ``concurrency`` of them are in flight per stream."""
FIRST_PIECE = 1024 * 1024
"""Bytes of the GET that opens a stream: a manifest in one request, and little read in vain
by a stream that seeks away at once (the second half of a shard)."""
INTO_PIECE = 1024 * 1024
"""Largest single read of a ``read_range`` body into the caller's buffer: what a read that
breaks mid-way had received is lost (the socket's read returns no count), so a resume reads at
most this much again."""
_BLOCK_RE = re.compile(r"^(?P<upload>[0-9a-f]{16})\.(?P<part>\d{5})\.(?P<stamp>\d{13})$")
_CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
_BODY_BREAKS = (AzureError, http.client.HTTPException, OSError, urllib3.exceptions.HTTPError)
"""What a body read raises when its connection breaks: the socket's and http.client's errors
(read straight from them), urllib3's, and azure-core's (the chunks of other transports)."""
T = TypeVar("T")


def _code(exc: BaseException) -> str:
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or "")


def _quoted(etag: object) -> str:
    text = str(etag or "").strip('"')
    return f'"{text}"' if text else ""


class ServerClock:
    """The storage's clock as seen in its answers' ``Date`` headers, read off every response.

    Azure records no time for an uncommitted block, so each block id carries when it was staged
    on the storage's clock (this host's clock plus the offset measured here): GC ages an upload
    by its newest block on the same clock that stamps objects, whatever this host's skew.
    ``Date`` has one-second resolution (the middle of its second is taken): stamps are within
    about a second of the storage's clock, which GC's grace period (an hour) dwarfs.
    """

    def __init__(self) -> None:
        self.offset = 0.0

    def observe(self, pipeline_response: Any) -> None:
        """A ``raw_response_hook``: take the offset from the answer's ``Date``."""
        header = pipeline_response.http_response.headers.get("Date")
        if not header:
            return
        with contextlib.suppress(TypeError, ValueError):
            self.offset = parsedate_to_datetime(header).timestamp() + 0.5 - time.time()

    def now(self) -> float:
        return time.time() + self.offset


def encode_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """User metadata as Azure takes it: names are C# identifiers (letters, digits, ``_``),
    compared without case. Names are lowercased (as S3 returns them) and escaped reversibly:
    ``_`` as ``__``, ``-`` as ``_h``, any other character as ``_xHH``, a leading digit after
    ``_n``."""
    encoded = {}
    for name, value in metadata.items():
        out = []
        for char in name.lower():
            if char.isascii() and char.isalnum():
                out.append(char)
            elif char == "_":
                out.append("__")
            elif char == "-":
                out.append("_h")
            else:
                out.append(f"_x{ord(char):02x}")
        text = "".join(out)
        encoded[f"_n{text}" if text[:1].isdigit() else text] = value
    return encoded


def decode_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The names ``encode_metadata`` made, back; a name it could not have made is kept as is."""
    decoded = {}
    for name, value in (metadata or {}).items():
        decoded[_decode_name(name)] = value
    return decoded


def _decode_name(name: str) -> str:
    out, index = [], 2 if name.startswith("_n") else 0
    while index < len(name):
        char = name[index]
        if char != "_":
            out.append(char)
            index += 1
            continue
        escape = name[index + 1 : index + 2]
        if escape == "_":
            out.append("_")
        elif escape == "h":
            out.append("-")
        elif escape == "x" and re.fullmatch(r"[0-9a-f]{2}", name[index + 2 : index + 4]):
            out.append(chr(int(name[index + 2 : index + 4], 16)))
            index += 2
        else:
            return name
        index += 2
    return "".join(out)


@dataclass(frozen=True)
class _Block:
    upload_id: str
    part_number: int
    staged: float
    size: int


_Blocks = list[_Block]  # (the driver's ``list`` method hides the builtin in its class)
_Names = list[str]
_Items = list[Any]


def block_id(upload_id: str, part_number: int, staged: float) -> str:
    """The block id of one part (the SDK base64-encodes it on the wire): every id of a blob has
    the same length, as Azure requires."""
    return f"{upload_id}.{part_number:05d}.{int(staged * 1000):013d}"


def _parse_block(block: Any) -> _Block | None:
    """Our block's upload id, part and staging time; None for a block someone else staged."""
    match = _BLOCK_RE.fullmatch(str(getattr(block, "id", "") or ""))  # decoded by the SDK
    if match is None:
        return None
    return _Block(
        match["upload"], int(match["part"]), int(match["stamp"]) / 1000, int(block.size or 0)
    )


@dataclass(frozen=True)
class RangeAnswer:
    """One ranged GetBlob's answer, its body not yet read (``AzureBlobDriver.open_range``)."""

    content_range: str
    """The answer's ``Content-Range`` (empty if it has none: the server ignored the Range)."""
    info: ObjectInfo
    """The blob's ETag, Last-Modified and version as the answer gives them (``size``: 0)."""
    readinto: Callable[[memoryview], int]
    """Reads the body's next bytes into a buffer; 0 at its end (or where it ended early)."""
    done: Callable[[], None]
    """Called once the body was read to its end: its connection goes back to the pool."""
    close: Callable[[], None]
    """Lets go of the answer, read or not (always called, after ``done`` if at all)."""


class _Chunks:
    """A body given as a series of ``bytes`` (azure-core's ``stream_download``), read into
    buffers: each byte copied once more than a read straight from the socket."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._left = memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        if not self._left.nbytes:
            chunk = next(self._chunks, b"")
            if not chunk:
                return 0
            self._left = memoryview(chunk).cast("B")
        count = min(view.nbytes, self._left.nbytes)
        view[:count] = self._left[:count]
        self._left = self._left[count:]
        return count

    def done(self) -> None:
        """Reach the end of the chunks, where azure-core lets go of the connection."""
        next(self._chunks, None)


def direct_body_reads(raw: object) -> bool:
    """Whether a fresh answer's body (``requests.Response.raw``) has the layers
    ``_body_reader`` reads straight from: an unread urllib3 response over an http.client one
    (for the canary test)."""
    return (
        isinstance(raw, urllib3.response.HTTPResponse)
        and isinstance(getattr(raw, "_fp", None), http.client.HTTPResponse)
        and getattr(raw, "_fp_bytes_read", None) == 0
    )


def _body_reader(
    response: Any, chunks: Iterator[bytes]
) -> tuple[Callable[[memoryview], int], Callable[[], None]]:
    """How to read a GetBlob answer's body into a buffer: a ``readinto``, and what to call
    once it was read to its end.

    Straight from the http.client response under requests' and urllib3's when the layers are
    the known ones and unread: one copy, from the socket into the caller's buffer (urllib3's
    own ``readinto`` reads into a new bytes object and copies it; azure-core's chunks are
    bytes objects too). Else from ``chunks`` (azure-core's ``stream_download`` of the body,
    undecoded), copied. Known layers: azure-core's requests transport (what ``open_azure``
    configures) over urllib3 2.x (tested with azure-core 1.41, urllib3 2.8); a canary test
    (tests/test_azure_read_range.py) fails loudly on versions that changed them, and the
    fallback keeps reads correct meanwhile. Either way the bytes are the stored ones: no
    ``Content-Encoding`` is decoded.
    """
    raw: Any = getattr(getattr(response, "internal_response", None), "raw", None)
    if direct_body_reads(raw) and not raw._fp.isclosed():  # noqa: SLF001
        return raw._fp.readinto, raw.release_conn  # noqa: SLF001
    fallback = _Chunks(chunks)
    return fallback.readinto, fallback.done


def _range_total(content_range: str, first: int, last: int, what: str) -> int:
    """The blob's size from a ranged answer's Content-Range; StorageError unless the answer
    holds exactly bytes ``first``..``last`` (a server that ignored the Range, or a blob that
    ends before ``last``)."""
    match = _CONTENT_RANGE_RE.fullmatch(content_range)
    if not match or (int(match[1]), int(match[2])) != (first, last):
        raise StorageError(
            errno.EIO,
            f"{what}: the server answered {content_range or 'the whole blob'} (is the range "
            f"past the blob's end?)",
        )
    return int(match[3])


class AzureBlobDriver(ObjectStoreBase, RangedReadDriver):
    """Object-store primitives on one Azure Blob container under a name prefix."""

    scheme = "az"
    rules = AZURE_RULES
    store_noun = "container"
    store_hint = "create it, or check the account and endpoint"
    refusal_status = 409  # Azurite's BlobAlreadyExists (Azure answers 412 ConditionNotMet)
    reader_threads = "ckptstore-az-read"
    max_parts = AZURE_MAX_BLOCKS

    def __init__(
        self,
        client: ContainerClient,
        container: str,
        prefix: str = "",
        *,
        identity: str | None = None,
        clock: ServerClock | None = None,
        **settings: Unpack[DriverSettings],
    ) -> None:
        super().__init__(container, prefix, endpoint=identity or str(client.url), **settings)
        self.client = client
        self.container = container
        self.server_clock = clock or ServerClock()
        """Not ``clock``: a driver's ``clock`` stamps its writes (the memory driver's), and the
        conformance suite sets it to age leftovers; Azure stamps its own writes."""
        self._metadata: dict[str, dict[str, str]] = {}
        self._metadata_lock = threading.Lock()
        self._read_ahead = ReadAhead(READ_PIECE, self.read_concurrency, self.executor)
        self.capabilities = S3_LIKE | {Capability.CONDITIONAL_MULTIPART_COMPLETE}

    # -- plumbing ------------------------------------------------------------------------

    def _blob(self, key: str) -> Any:
        return self.client.get_blob_client(self.full(key))

    def _validate(self) -> dict[str, Any]:
        """Content-MD5 on each request, which the service checks against the bytes it got."""
        return {"validate_content": True} if self.checksums else {}

    def _info(self, key: str, response: Mapping[str, Any], size: int) -> ObjectInfo:
        return ObjectInfo(
            key=key,
            size=size,
            etag=_quoted(response.get("etag")),
            last_modified=timestamp(response.get("last_modified")),
            version_id=response.get("version_id") or None,
        )

    def properties_info(self, key: str, properties: Any) -> ObjectInfo:
        """What GetBlobProperties, or the first answer of a ranged GetBlob, says of a blob."""
        size = int(properties.size or 0)
        whole = str(getattr(properties, "content_range", None) or "").rpartition("/")[2]
        if whole.isdigit():  # a ranged answer: properties.size is the range's
            size = int(whole)
        return ObjectInfo(
            key=key,
            size=size,
            etag=_quoted(properties.etag),
            last_modified=timestamp(properties.last_modified),
            version_id=getattr(properties, "version_id", None) or None,
            metadata=decode_metadata(properties.metadata),
        )

    # -- the driver interface ------------------------------------------------------------

    def probe_bucket(self) -> tuple[str, Callable[[], object]]:
        return "GetContainerProperties", self.client.get_container_properties

    def put_request(
        self, key: str, body: bytes, mode: PutMode, metadata: Mapping[str, str] | None
    ) -> PutRequest:
        args: dict[str, Any] = {"length": len(body), "overwrite": mode.kind != "create"}
        args.update(self._validate())
        if metadata:
            args["metadata"] = encode_metadata(metadata)
        if mode.kind == "update":
            args["etag"] = _quoted(mode.etag)
            args["match_condition"] = MatchConditions.IfNotModified
        blob = self._blob(key)
        what = f"PutBlob {key}"
        if mode.conditional:
            what += " (If-None-Match)" if mode.kind == "create" else " (If-Match)"
        return PutRequest(what, lambda: self._info(key, blob.upload_blob(body, **args), len(body)))

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        with self._open_stream(key, version_id) as stream:
            return stream.read(), stream.info

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        """A stream of the object that fetches ranges ahead in parallel, each pinned to the
        first answer's ETag (callers check the bytes end to end)."""
        return cast(BinaryIO, self._open_stream(key, version_id))

    def _open_stream(self, key: str, version_id: str | None) -> RangeReader:
        """Opened by one small ranged GET (a manifest arrives whole, and a stream that seeks
        away at once reads little in vain); then ``READ_PIECE`` ranges on a fixed grid, each
        with ``If-Match`` the first answer's ETag (or the version asked for)."""
        first, properties = self.get_range(key, version_id, 0, FIRST_PIECE, None)
        info = self.properties_info(key, properties)
        etag = info.etag if version_id is None else None
        return RangeReader(
            info,
            lambda offset, length: self.get_range(key, version_id, offset, length, etag)[0],
            pin=f"{self.storage_identity[0]}/{self.full(key)}#{etag or version_id}",
            ahead=self._read_ahead,
            first=first,
        )

    def get_range(
        self, key: str, version_id: str | None, offset: int, length: int, etag: str | None
    ) -> tuple[bytes, Any]:
        """``length`` bytes from ``offset`` (fewer at the end) and the blob's properties."""
        args: dict[str, Any] = {"offset": offset, "length": length, "max_concurrency": 1}
        if version_id is not None:
            args["version_id"] = version_id
        if etag:
            args["etag"] = etag
            args["match_condition"] = MatchConditions.IfNotModified
        blob = self._blob(key)

        def call() -> tuple[bytes, Any]:
            try:
                downloader = blob.download_blob(**args)
            except HttpResponseError as exc:
                if offset or _code(exc) != "InvalidRange":
                    raise
                downloader = blob.download_blob(**{**args, "offset": None, "length": None})
            return downloader.readall(), downloader.properties  # an empty blob has no range 0-

        return self.retried(f"GetBlob {key} [{offset}+{length}]", call, key=key)

    def read_range(
        self,
        key: str,
        offset: int,
        into: BytesLike,
        *,
        version_id: str | None = None,
        if_match: str | None = None,
    ) -> ObjectInfo:
        """Bytes ``offset`` to ``offset + len(into)`` of one blob (version), every one from it,
        straight into ``into``: a ranged GetBlob ``If-Match: if_match`` (without it, every
        resume is pinned to the first answer's ETag); a body that breaks is asked for again
        from the byte reached, under the same condition, up to ``max_attempts`` answers."""
        view = memoryview(into).cast("B")
        if view.readonly:
            raise InvalidInputError("read_range needs a writable buffer")
        if offset < 0:
            raise InvalidInputError(f"read_range of {key}: offset {offset} is negative")
        pin = _quoted(if_match) or None
        if not view.nbytes:
            info = self.head(key, version_id=version_id)
            if pin and info.etag != pin:
                raise PreconditionFailedError(
                    f"GetBlobProperties {key}: the ETag is {info.etag}, not {pin}",
                    http_status=412,
                )
            return info
        with naming(self.url, key):
            return self._read_range(key, offset, view, version_id, pin)

    def _read_range(
        self, key: str, offset: int, view: memoryview, version_id: str | None, pin: str | None
    ) -> ObjectInfo:
        end = offset + view.nbytes - 1
        got, tries = 0, 0
        while True:
            tries += 1
            start = offset + got
            what = f"GetBlob {key} bytes {start}-{end}"
            try:
                answer = self.retried(
                    what,
                    functools.partial(
                        self.open_range, key, start, end, version_id=version_id, etag=pin
                    ),
                    key=key,
                )
            except PreconditionFailedError as refused:
                # Azurite refuses a conditional GetBlob of a deleted blob with 412, as if it
                # were replaced: a HEAD tells them apart (ObjectNotFoundError if deleted).
                try:
                    self.head(key, version_id=version_id)
                except ObjectNotFoundError:
                    raise
                except StorageError:
                    pass  # nothing more to learn: the refusal stands
                raise refused
            try:
                total = _range_total(answer.content_range, start, end, what)
                etag = answer.info.etag
                if pin and etag and etag != pin:  # a server that ignored the If-Match
                    raise PreconditionFailedError(
                        f"{what}: the answer is of ETag {etag}, not {pin}", http_status=412
                    )
                pin = pin or etag or None
                while got < view.nbytes:
                    try:
                        count = answer.readinto(view[got : got + INTO_PIECE])
                    except CkptStoreError:
                        raise
                    except _BODY_BREAKS as exc:
                        raise TransientStorageError(
                            errno.ECONNRESET,
                            f"{what}: the connection broke at byte {offset + got} "
                            f"({first_line(exc)})",
                        ) from exc
                    if not count:
                        raise TransientStorageError(
                            errno.ECONNRESET, f"{what}: the body ended at byte {offset + got}"
                        )
                    got += count
                answer.done()
            except TransientStorageError as exc:
                if tries >= self.max_attempts or not (pin or version_id):
                    raise  # out of answers, or nothing pins a resume to the same blob
                log.info("%s: %s; resuming at byte %d", what, exc, offset + got)
                continue
            finally:
                answer.close()
            return replace(answer.info, size=total)

    def open_range(
        self,
        key: str,
        first: int,
        last: int,
        *,
        version_id: str | None = None,
        etag: str | None = None,
    ) -> RangeAnswer:
        """One GetBlob of bytes ``first``..``last`` (``If-Match: etag``, of ``version_id``),
        sent once, its body left unread for the caller (who closes the answer).

        The one place that reaches below azure-storage-blob's public API, for speed: its
        ``download_blob`` reads an answer's body whole and joins its pieces into one bytes
        object before any ``readinto`` copies it out (and retries a broken body from its start,
        with sleeps of its own). This calls the generated GetBlob operation that the SDK's own
        downloader calls (``BlobClient._client.blob.download``), whose answer comes back with
        its body unread; ``_body_reader`` reads it.
        """
        blob = self._blob(key)
        try:
            response, chunks, fields = blob._client.blob.download(  # noqa: SLF001
                range=f"bytes={first}-{last}",
                version_id=version_id,
                decompress=False,
                headers={"If-Match": etag} if etag else {},
                cls=lambda answer, body, headers: (answer.http_response, body, headers),
            )
        except HttpResponseError as exc:
            # The generated layer leaves the service's error code in its header; the error
            # table reads it from the exception, as the SDK's public calls leave it.
            if not getattr(exc, "error_code", None) and exc.response is not None:
                exc.error_code = exc.response.headers.get("x-ms-error-code")  # type: ignore[attr-defined]
            raise
        try:
            readinto, done = _body_reader(response, chunks)
            info = ObjectInfo(
                key=key,
                size=0,
                etag=_quoted(fields.get("ETag")),
                last_modified=timestamp(fields.get("Last-Modified")),
                version_id=fields.get("x-ms-version-id") or None,
            )
        except BaseException:
            response.close()
            raise
        content_range = str(fields.get("Content-Range") or "")
        return RangeAnswer(content_range, info, readinto, done, response.close)

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        blob = self._blob(key)
        properties = self.retried(
            f"GetBlobProperties {key}",
            lambda: blob.get_blob_properties(version_id=version_id),
            key=key,
        )
        return self.properties_info(key, properties)

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        blob = self._blob(key)
        with contextlib.suppress(ObjectNotFoundError):  # deleting what is gone is no error
            self.retried(
                f"DeleteBlob {key}", lambda: blob.delete_blob(version_id=version_id), key=key
            )

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Listed from ``start_after`` with ``startFrom`` (inclusive; a server that ignores it
        only costs time: names up to ``start_after`` are dropped here)."""
        after = self.full(start_after) if start_after is not None else None
        args: dict[str, Any] = {"name_starts_with": self.full(prefix)}
        if after is not None:
            args["start_from"] = after
        for item in self._pages("ListBlobs", args):
            if after is not None and item.name <= after:
                continue
            yield self._listed(item)

    def _listed(self, item: Any) -> ObjectInfo:
        return ObjectInfo(
            key=self.relative(item.name),
            size=int(item.size or 0),
            etag=_quoted(item.etag),
            last_modified=timestamp(item.last_modified),
        )

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        """Without blob versioning, each object is its only (and latest) version."""
        yield from self.list(prefix)

    def _pages(self, what: str, args: Mapping[str, Any]) -> Iterator[Any]:
        """Every item of a listing, each page request retried on its own."""

        def page(marker: str | None) -> tuple[_Items, str | None]:
            sized: dict[str, Any] = (
                {"results_per_page": self.list_page_size} if self.list_page_size else {}
            )
            pages: Any = self.client.list_blobs(**args, **sized).by_page(continuation_token=marker)
            items = list(next(pages))
            return items, pages.continuation_token or None

        return self.pages(what, page)

    # -- multipart: blocks staged, then committed ----------------------------------------

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        """A new upload id; nothing is sent (Azure has no upload object: blocks make one)."""
        upload_id = secrets.token_hex(8)
        if metadata:
            with self._metadata_lock:
                self._metadata[upload_id] = encode_metadata(metadata)
        return upload_id

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        if not 1 <= part_number <= AZURE_MAX_BLOCKS:
            raise StorageError(f"{key}: part number {part_number} out of 1..{AZURE_MAX_BLOCKS}")
        body = data if isinstance(data, bytes) else bytes(data)
        name = block_id(upload_id, part_number, self.server_clock.now())
        blob = self._blob(key)
        validate = self._validate()
        self.retried(
            f"PutBlock {key} #{part_number}",
            lambda: blob.stage_block(name, body, length=len(body), **validate),
            key=key,
        )
        return PartInfo(part_number, name, len(body))

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        """Put Block List of the parts' blocks; a create sends ``If-None-Match: *``.

        Blocks that are gone (GC freed the upload) make it fail with ObjectNotFoundError.
        """
        blocks = [BlobBlock(part.etag) for part in parts]
        with self._metadata_lock:
            metadata = self._metadata.get(upload_id)
        args: dict[str, Any] = {"metadata": metadata} if metadata else {}
        if create:
            args["match_condition"] = MatchConditions.IfMissing
        blob = self._blob(key)
        what = f"PutBlockList {key}" + (" (If-None-Match)" if create else "")
        size = sum(part.size for part in parts)
        ids = [part.etag for part in parts]
        if create and self.raw_conditionals:
            response = self.once(what, lambda: blob.commit_block_list(blocks, **args))
            info = self._info(key, response, size)
        elif create:
            info = self._commit_create(what, key, ids, size, lambda: blob.commit_block_list(
                blocks, **args))  # fmt: skip
        else:  # the same list committed again commits the same blocks: safe to retry
            info = self._info(key, self.retried(
                what, lambda: blob.commit_block_list(blocks, **args)), size)  # fmt: skip
        with self._metadata_lock:
            self._metadata.pop(upload_id, None)
        return info

    def _commit_create(
        self, what: str, key: str, ids: _Names, size: int, send: Callable[[], Any]
    ) -> ObjectInfo:
        """A conditional commit retried until its outcome is known (I8): after a broken call,
        the blob's committed block list says whether it is ours (our block ids are unique)."""

        def read_back() -> ObjectInfo | Holder:
            committed = self._committed_ids(key)
            if committed is None:
                return Holder.NOBODY
            return self.head(key) if committed == ids else Holder.ANOTHER_WRITER

        return self.resolve_create(what, lambda: self._info(key, send(), size), read_back)

    def _committed_ids(self, key: str) -> _Names | None:
        """The committed block ids of a blob; None if it has no committed content."""
        blob = self._blob(key)
        try:
            committed, _ = self.retried(
                f"GetBlockList {key}", lambda: blob.get_block_list("committed")
            )
        except ObjectNotFoundError:
            return None
        return [str(block.id) for block in committed]

    def _blocks(self, key: str) -> tuple[bool, _Blocks]:
        """Whether the blob has committed content, and our uncommitted blocks on it."""
        blob = self._blob(key)
        committed, uncommitted = self.retried(
            f"GetBlockList {key}", lambda: blob.get_block_list("all")
        )
        parsed = [_parse_block(block) for block in uncommitted]
        return bool(committed), [block for block in parsed if block is not None]

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Free the upload's uncommitted blocks: an empty block list committed only if the blob
        has no content (``If-None-Match: *``; Put Block List discards every uncommitted block
        it does not name), then that empty blob deleted (``If-Match`` its ETag).

        Azure has no call that discards uncommitted blocks alone. Beside a committed blob (a
        create-only completion that was refused), they are left to Azure, which discards
        uncommitted blocks after seven days; rewriting the blob would change its ETag.
        """
        with self._metadata_lock:
            self._metadata.pop(upload_id, None)
        try:
            has_content, blocks = self._blocks(key)
        except ObjectNotFoundError:
            return  # nothing staged, or freed already
        if has_content or not any(block.upload_id == upload_id for block in blocks):
            return
        blob = self._blob(key)
        what = f"PutBlockList {key} (empty, If-None-Match: discards the upload's blocks)"
        try:
            empty = self.once(
                what, lambda: blob.commit_block_list([], match_condition=MatchConditions.IfMissing)
            )
        except PreconditionFailedError:
            return  # committed meanwhile: a blob with content is never replaced here
        except TransientStorageError:
            # Unknown outcome: an empty blob may be there; the next GC deletes it as a
            # leftover object of the dead attempt. Try once more now, as a conditional delete.
            self._delete_if_empty(key)
            return
        etag = _quoted(empty.get("etag"))
        with contextlib.suppress(PreconditionFailedError, ObjectNotFoundError):
            self.retried(
                f"DeleteBlob {key} (If-Match)",
                lambda: blob.delete_blob(etag=etag, match_condition=MatchConditions.IfNotModified),
            )

    def _delete_if_empty(self, key: str) -> None:
        with contextlib.suppress(ObjectNotFoundError, PreconditionFailedError):
            info = self.head(key)
            if info.size == 0:
                blob = self._blob(key)
                self.retried(
                    f"DeleteBlob {key} (If-Match)",
                    lambda: blob.delete_blob(
                        etag=info.etag, match_condition=MatchConditions.IfNotModified
                    ),
                )

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        """Blobs that hold uncommitted blocks of ours and no content: the names a listing
        with ``uncommittedblobs`` has and a plain listing has not; each one's block list says
        which uploads it holds and when each began."""
        full = self.full(prefix)
        plain = self._pages("ListBlobs", {"name_starts_with": full})
        committed = next(plain, None)
        for item in self._pages(
            "ListBlobs (uncommitted)", {"name_starts_with": full, "include": ["uncommittedblobs"]}
        ):
            while committed is not None and committed.name < item.name:
                committed = next(plain, None)
            if committed is not None and committed.name == item.name:
                continue
            key = self.relative(item.name)
            try:
                has_content, blocks = self._blocks(key)
            except ObjectNotFoundError:
                continue  # committed or freed meanwhile
            if has_content:
                continue
            uploads: dict[str, float] = {}
            for block in blocks:
                uploads[block.upload_id] = min(uploads.get(block.upload_id, block.staged),
                                               block.staged)  # fmt: skip
            for upload_id, initiated in sorted(uploads.items(), key=lambda u: u[1]):
                yield UploadInfo(key=key, upload_id=upload_id, initiated=initiated)

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        try:
            has_content, blocks = self._blocks(upload.key)
        except ObjectNotFoundError:
            has_content, blocks = False, []
        ours = [block for block in blocks if block.upload_id == upload.upload_id]
        if has_content or not ours:
            raise ObjectNotFoundError(
                errno.ENOENT, f"{self.url}/{upload.key}: upload {upload.upload_id} is gone"
            )
        return UploadProgress(
            last_activity=max(block.staged for block in ours),
            size=sum(block.size for block in ours),
            parts=len({block.part_number for block in ours}),
        )


__getattr__ = served_from(__name__, "ckptstore.backends.azure_open")
"""``azure_open``'s names (``open_azure``, ``parse_location``, ...), still served from here."""
