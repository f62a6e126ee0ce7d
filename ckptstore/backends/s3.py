"""S3 driver on boto3: ``s3://bucket/prefix``, committed by a conditional put.

The protocol: docs/protocol.md §3-4; this backend: docs/backends/s3.md.

Works with AWS S3 and S3-compatible systems (``endpoint_url``). Shards go to attempt-unique
keys, as single puts or as multipart uploads whose parts upload concurrently, each with its
CRC32C sent as an S3 additional checksum; the manifest is published with ``If-None-Match: *``.
Idempotent calls are retried on transient errors with bounded exponential backoff and jitter
(tenacity); conditional writes are never retried blindly: a conditional create whose outcome is
unknown is resolved by reading the key back, and a compare-and-swap's surfaces as
``IndeterminateOutcomeError`` for the protocol to read back (I8). A body read that breaks
mid-way resumes with a ranged GET conditional on the object's ETag.
"""

from __future__ import annotations

import errno
import functools
import http.client
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import urllib3

from ckptstore.backends.moved import served_from
from ckptstore.backends.object_store import S3_LIKE, ObjectStoreBase, PutRequest, pinned_read
from ckptstore.backends.resuming_reader import READ_PIECE, ResumingReader
from ckptstore.backends.s3_errors import S3_RULES, translate_s3_errors
from ckptstore.backends.wire_format import crc32c_b64, timestamp
from ckptstore.driver import (
    Capability,
    ObjectInfo,
    PartInfo,
    RangedReadDriver,
    UploadInfo,
    UploadProgress,
)
from ckptstore.errors import (
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ckptstore.backends.object_store import DriverSettings
    from ckptstore.backends.s3_open import CREDENTIAL_OPTIONS as CREDENTIAL_OPTIONS
    from ckptstore.backends.s3_open import URL_OPTIONS as URL_OPTIONS
    from ckptstore.backends.s3_open import (
        install_abort_incomplete_uploads_rule as install_abort_incomplete_uploads_rule,
    )
    from ckptstore.backends.s3_open import make_client as make_client
    from ckptstore.backends.s3_open import open_s3 as open_s3
    from ckptstore.backends.s3_open import open_s3_versioned as open_s3_versioned
    from ckptstore.backends.s3_open import parse_location as parse_location
    from ckptstore.driver import Buffer, BytesLike, PutMode

__all__ = [
    "S3_MIN_PART_SIZE",
    "S3Driver",
    "direct_body_reads",
    "install_abort_incomplete_uploads_rule",
    "open_s3",
    "open_s3_versioned",
]

log = logging.getLogger(__name__)

S3_MIN_PART_SIZE = 5 * 1024 * 1024
S3_MAX_PARTS = 10_000
Markers = tuple[tuple[str, str], ...]
"""Request parameters that continue a listing after a truncated page."""


_PAGE_SIZE = {
    "list_objects_v2": "MaxKeys",
    "list_object_versions": "MaxKeys",
    "list_multipart_uploads": "MaxUploads",
    "list_parts": "MaxParts",
}
"""The argument of each listing that sets its page size (``list_page_size``)."""
_PAGE_MARKERS: dict[str, tuple[tuple[str, str], ...]] = {
    "list_objects_v2": (("ContinuationToken", "NextContinuationToken"),),
    "list_object_versions": (
        ("KeyMarker", "NextKeyMarker"), ("VersionIdMarker", "NextVersionIdMarker"),
    ),
    "list_multipart_uploads": (
        ("KeyMarker", "NextKeyMarker"), ("UploadIdMarker", "NextUploadIdMarker"),
    ),
    "list_parts": (("PartNumberMarker", "NextPartNumberMarker"),),
}  # fmt: skip
"""Request parameter <- response field that continue each listing after a truncated page."""


class S3Driver(ObjectStoreBase, RangedReadDriver):
    """Object-store primitives on one S3 bucket under a key prefix, through a boto3 client."""

    scheme = "s3"
    rules = S3_RULES
    store_hint = "create it, or check the name, region and endpoint"
    max_parts = S3_MAX_PARTS

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        versioned: bool = False,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        **settings: Unpack[DriverSettings],
    ) -> None:
        settings.setdefault("min_part_size", S3_MIN_PART_SIZE)
        endpoint = str(getattr(client.meta, "endpoint_url", "") or "")
        super().__init__(bucket, prefix, endpoint=endpoint, **settings)
        self.bucket = bucket
        self.client = client
        self._encryption: dict[str, str] = {}
        if sse:
            self._encryption["ServerSideEncryption"] = sse
        if sse_kms_key_id:
            self._encryption["SSEKMSKeyId"] = sse_kms_key_id
        self._quote_etags = True
        self._quote_read_etags = True
        versions = {Capability.VERSIONING, Capability.VERSION_DELETE}
        self.capabilities = S3_LIKE | versions if versioned else S3_LIKE

    def _info(self, key: str, response: Mapping[str, Any], size: int) -> ObjectInfo:
        return ObjectInfo(
            key=key,
            size=int(response.get("ContentLength", size)),
            etag=str(response.get("ETag", "")),
            last_modified=timestamp(response.get("LastModified")),
            version_id=_version(response.get("VersionId")),
            metadata=response.get("Metadata"),
        )

    # -- the driver interface ------------------------------------------------------------

    def probe_bucket(self) -> tuple[str, Callable[[], object]]:
        return "HeadBucket", lambda: self.client.head_bucket(Bucket=self.bucket)

    def put_request(
        self, key: str, body: bytes, mode: PutMode, metadata: Mapping[str, str] | None
    ) -> PutRequest:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.full(key), "Body": body}
        args.update(self._encryption)
        if metadata:
            args["Metadata"] = dict(metadata)
        if self.checksums:
            args["ChecksumCRC32C"] = crc32c_b64(body)
        if mode.kind == "create":
            args["IfNoneMatch"] = "*"
        elif mode.etag is not None and self.raw_conditionals:
            args["IfMatch"] = mode.etag  # exactly as given: the quoting is measured
        elif mode.etag is not None:
            etag = mode.etag
            return PutRequest(
                f"PutObject {key} (If-Match)",
                lambda: self._put_if_match(key, args, etag, len(body)),
            )
        condition = {"create": " (If-None-Match)", "update": " (If-Match)"}.get(mode.kind, "")
        return PutRequest(
            f"PutObject {key}{condition}",
            lambda: self._info(key, self.client.put_object(**args), len(body)),
        )

    def _put_if_match(self, key: str, args: dict[str, Any], etag: str, size: int) -> ObjectInfo:
        """PutObject If-Match, working around servers that reject one of the ETag quotings."""
        bare = etag.strip('"')
        for quoted in (self._quote_etags, not self._quote_etags):
            args["IfMatch"] = f'"{bare}"' if quoted else bare
            try:
                response = self.once(
                    f"PutObject {key} (If-Match)", lambda: self.client.put_object(**args)
                )
            except PreconditionFailedError:
                if self.head(key).etag.strip('"') != bare:
                    raise  # the object really changed
                continue  # same ETag refused: the server wants the other quoting
            if quoted != self._quote_etags:
                log.info("%s: the server wants %s ETags in If-Match", self.url,
                         "quoted" if quoted else "unquoted")  # fmt: skip
                self._quote_etags = quoted
            return self._info(key, response, size)
        raise PreconditionFailedError(
            f"{self.url}/{key}: If-Match refused in both quotings", http_status=412
        )

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        """The whole object; a read that broke past its resumes is read again whole."""

        def read() -> tuple[bytes, ObjectInfo]:
            with self._open_stream(key, version_id, retried=False) as stream:
                data = stream.read()
            return data, stream.info

        return self.retrying(read)

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        """A stream of the object that resumes after a broken connection (callers check the
        bytes end to end: a shard's CRC32C, a manifest's own checksum)."""
        return cast(BinaryIO, self._open_stream(key, version_id, retried=True))

    def _open_stream(self, key: str, version_id: str | None, *, retried: bool) -> ResumingReader:
        args = self._object_args(key, version_id)
        call = self.retried if retried else self.once
        response = call(f"GetObject {key}", lambda: self.client.get_object(**args), key=key)
        etag = str(response.get("ETag") or "")
        where = f"reading s3://{self.bucket}/{self.full(key)}"

        def reopen(position: int) -> Any:
            """The object's rest from ``position``: a GET Range If-Match (and version)."""
            what = f"GetObject {key} from byte {position}"
            again = {**args, "Range": f"bytes={position}-", "IfMatch": etag}
            with pinned_read(where, position):
                answer = self.retried(what, lambda: self.client.get_object(**again), key=key)
            reached = str(answer.get("ContentRange", ""))
            if not reached.startswith(f"bytes {position}-"):
                answer["Body"].close()
                raise StorageError(
                    errno.EIO,
                    f"{what}: the server ignored the Range (answered {reached or 'whole'})",
                )
            return answer["Body"]

        return ResumingReader(
            response["Body"],
            self._info(key, response, 0),
            size=int(response.get("ContentLength", -1)),
            what=where,
            pinned=bool(etag),
            max_attempts=self.max_attempts,
            translate=lambda: translate_s3_errors(where, bucket=self.bucket),
            reopen=reopen,
        )

    def read_range(
        self,
        key: str,
        offset: int,
        into: BytesLike,
        *,
        version_id: str | None = None,
        if_match: str | None = None,
    ) -> ObjectInfo:
        """A GET Range (If-Match ``if_match``) read straight into ``into``; a body that breaks
        is asked for again from the byte reached, under the same If-Match."""
        view = memoryview(into).cast("B")
        if view.readonly:
            raise InvalidInputError("read_range needs a writable buffer")
        args = self._object_args(key, version_id)
        bare = (if_match or "").strip('"')
        if if_match:
            args["IfMatch"] = f'"{bare}"' if self._quote_read_etags else bare
        if not view.nbytes:
            info = self.head(key, version_id=version_id)
            if if_match and info.etag.strip('"') != bare:
                raise PreconditionFailedError(f"HeadObject {key}: ETag is {info.etag}")
            return info
        end = offset + view.nbytes - 1
        got, tries, requoted = 0, 0, False
        while True:
            tries += 1
            what = f"GetObject {key} bytes {offset + got}-{end}"
            ranged = {**args, "Range": f"bytes={offset + got}-{end}"}
            try:
                response = self.retried(
                    what, functools.partial(self.client.get_object, **ranged), key=key
                )
            except PreconditionFailedError:
                if (
                    not if_match
                    or requoted
                    or self.head(key, version_id=version_id).etag.strip('"') != bare
                ):
                    raise  # the object really changed
                requoted = True  # same ETag refused: the server wants the other quoting
                quoted = not args["IfMatch"].startswith('"')  # whatever other threads chose
                self._quote_read_etags = quoted
                args["IfMatch"] = f'"{bare}"' if quoted else bare
                log.info("%s: the server wants %s ETags in If-Match on GET", self.url,
                         "quoted" if quoted else "unquoted")  # fmt: skip
                continue
            body = response["Body"]
            try:
                total = _range_total(response, offset + got, end, what)
                readinto, done = _body_reader(body)
                with translate_s3_errors(f"reading {what}", bucket=self.bucket):
                    while got < view.nbytes:
                        count = readinto(view[got : got + READ_PIECE])
                        if not count:  # the connection ended early: resume from here
                            raise TransientStorageError(
                                errno.ECONNRESET, f"{what}: the body ended at byte {got}"
                            )
                        got += count
                done()
            except TransientStorageError as exc:
                if tries >= self.max_attempts:
                    raise
                log.info("%s: connection broke (%s); resuming at byte %d", what, exc, got)
                continue
            finally:
                body.close()
            return ObjectInfo(
                key=key,
                size=total,
                etag=str(response.get("ETag", "")),
                last_modified=timestamp(response.get("LastModified")),
                version_id=_version(response.get("VersionId")),
            )

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        response = self.retried(
            f"HeadObject {key}",
            lambda: self.client.head_object(**self._object_args(key, version_id)),
            key=key,
        )
        return self._info(key, response, 0)

    def _object_args(self, key: str, version_id: str | None) -> dict[str, Any]:
        args = {"Bucket": self.bucket, "Key": self.full(key)}
        if version_id is not None:
            args["VersionId"] = version_id
        return args

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        self.retried(
            f"DeleteObject {key}",
            lambda: self.client.delete_object(**self._object_args(key, version_id)),
            key=key,
        )

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.full(prefix)}
        if start_after is not None:
            args["StartAfter"] = self.full(start_after)
        for page in self._pages("list_objects_v2", args):
            for item in page.get("Contents", []):
                yield ObjectInfo(
                    key=self.relative(item["Key"]),
                    size=int(item["Size"]),
                    etag=str(item.get("ETag", "")),
                    last_modified=timestamp(item.get("LastModified")),
                )

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        args = {"Bucket": self.bucket, "Prefix": self.full(prefix)}
        for page in self._pages("list_object_versions", args):
            entries = [(item, False) for item in page.get("Versions", [])]
            entries += [(item, True) for item in page.get("DeleteMarkers", [])]
            for item, marker in entries:
                yield ObjectInfo(
                    key=self.relative(item["Key"]),
                    size=int(item.get("Size", 0)),
                    etag=str(item.get("ETag", "")),
                    last_modified=timestamp(item.get("LastModified")),
                    version_id=_version(item.get("VersionId")),
                    is_delete_marker=marker,
                    is_latest=bool(item.get("IsLatest")),
                )

    def _pages(self, operation: str, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Every page of a listing, each page request retried on its own (a botocore
        paginator cannot be resumed after an error)."""
        markers = _PAGE_MARKERS[operation]
        call = getattr(self.client, operation)
        if self.list_page_size:
            args = {**args, _PAGE_SIZE[operation]: self.list_page_size}

        def page(following: Markers | None) -> tuple[list[dict[str, Any]], Markers | None]:
            answer: dict[str, Any] = call(**args, **dict(following or ()))
            if not answer.get("IsTruncated"):
                return [answer], None
            given = tuple((ask, answer[field]) for ask, field in markers if answer.get(field))
            if not given:
                raise StorageError(
                    f"{self.url}: {operation} says the listing is truncated but gives no new "
                    f"marker to continue from (none)"
                )
            return [answer], given

        return self.pages(operation, page)

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self.full(key)}
        args.update(self._encryption)
        if metadata:
            args["Metadata"] = dict(metadata)
        if self.checksums:
            args["ChecksumAlgorithm"] = "CRC32C"
        response = self.retried(
            f"CreateMultipartUpload {key}",
            lambda: self.client.create_multipart_upload(**args),
            key=key,
        )
        return str(response["UploadId"])

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        body = bytes(data)
        args: dict[str, Any] = {
            **self._upload_args(key, upload_id),
            "PartNumber": part_number,
            "Body": body,
        }
        checksum = crc32c_b64(body) if self.checksums else None
        if checksum:
            args["ChecksumCRC32C"] = checksum
        response = self.retried(
            f"UploadPart {key} #{part_number}", lambda: self.client.upload_part(**args), key=key
        )
        return PartInfo(part_number, str(response["ETag"]), len(body), checksum)

    def _upload_args(self, key: str, upload_id: str) -> dict[str, Any]:
        return {"Bucket": self.bucket, "Key": self.full(key), "UploadId": upload_id}

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        listed = []
        for part in parts:
            entry: dict[str, Any] = {"PartNumber": part.part_number, "ETag": part.etag}
            if part.checksum_crc32c and self.checksums:
                entry["ChecksumCRC32C"] = part.checksum_crc32c
            listed.append(entry)
        args: dict[str, Any] = {
            **self._upload_args(key, upload_id),
            "MultipartUpload": {"Parts": listed},
        }
        if create:
            args["IfNoneMatch"] = "*"
        what = f"CompleteMultipartUpload {key}"
        size = sum(part.size for part in parts)
        if create:
            response = self.once(what, lambda: self.client.complete_multipart_upload(**args))
        else:
            response = self._complete_idempotently(what, key, args, size)
        # botocore turns a 200 response with an embedded <Error> into an error. Some servers
        # answer success with an empty <ETag>: the object's own HEAD says what was made.
        if not response.get("ETag") and not self.raw_conditionals:
            response = self._completed_object(what, key, size)
        return self._info(key, response, size)

    def _completed_object(self, what: str, key: str, size: int) -> dict[str, Any]:
        """ETag, size and version of a just-completed object, from a HEAD: the key is
        attempt-unique, so the object there is the one the completion made (if its size is)."""
        info = self.head(key)
        if not info.etag or info.size != size:
            raise StorageError(
                errno.EIO,
                f"{what}: the completion's answer did not say what it made, and the object's "
                f"HEAD shows {info.size} bytes, ETag {info.etag or 'none'} (expected {size} bytes)",
            )
        return {"ETag": info.etag, "ContentLength": info.size, "VersionId": info.version_id}

    def _complete_idempotently(
        self, what: str, key: str, args: dict[str, Any], size: int
    ) -> dict[str, Any]:
        """Retry a completion; a retry that finds the upload gone finds our object instead."""
        tried = False

        def call() -> dict[str, Any]:
            nonlocal tried
            try:
                return dict(self.client.complete_multipart_upload(**args))
            except Exception:
                tried = True
                raise

        try:
            return self.retried(what, call)
        except ObjectNotFoundError:
            if not tried:
                raise
            return self._completed_object(what, key, size)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.retried(
            f"AbortMultipartUpload {key}",
            lambda: self.client.abort_multipart_upload(**self._upload_args(key, upload_id)),
            key=key,
        )

    def bucket_versioning(self) -> str:
        response = self.retried(
            "GetBucketVersioning", lambda: self.client.get_bucket_versioning(Bucket=self.bucket)
        )
        return str(response.get("Status", ""))

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        newest, size, parts = upload.initiated, 0, 0
        for page in self._pages("list_parts", self._upload_args(upload.key, upload.upload_id)):
            for part in page.get("Parts", []):
                newest = max(newest, timestamp(part.get("LastModified")))
                size += int(part.get("Size", 0))
                parts += 1
        return UploadProgress(last_activity=newest, size=size, parts=parts)

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        args = {"Bucket": self.bucket, "Prefix": self.full(prefix)}
        for page in self._pages("list_multipart_uploads", args):
            for upload in page.get("Uploads", []):
                yield UploadInfo(
                    key=self.relative(upload["Key"]),
                    upload_id=str(upload["UploadId"]),
                    initiated=timestamp(upload.get("Initiated")),
                )


def _version(value: Any) -> str | None:
    return None if value in (None, "", "null") else str(value)


def _body_reader(body: Any) -> tuple[Callable[[memoryview], int], Callable[[], None]]:
    """How to read a botocore body into a buffer: its ``readinto``, and what to call once it
    was read to its end.

    The one place that reaches below botocore's public API, for speed: urllib3's
    ``readinto`` reads into a new bytes object and copies it (http.client's ``read(n)``
    copies once more), three passes over every byte where one will do, on a machine whose
    cores the server may share. Read straight from the http.client response under the body
    when the layers are the known ones, untouched, and the body is not content-encoded (then
    the connection goes back to the pool once read to its end); else through the body's
    public ``readinto``. Known layers: botocore >= 1.35 with urllib3 2.x (tested up to
    botocore 1.43, urllib3 2.8); a canary test (tests/test_s3.py, "the private body layers")
    fails loudly on a version that changed them, and the fallback keeps reads correct.
    """
    raw: Any = getattr(body, "_raw_stream", None)
    if not direct_body_reads(body) or raw.headers.get("content-encoding", "identity") != "identity":
        return body.readinto, lambda: None
    if raw._fp.isclosed():  # noqa: SLF001
        return body.readinto, lambda: None
    return raw._fp.readinto, raw.release_conn  # noqa: SLF001


def direct_body_reads(body: Any) -> bool:
    """Whether a fresh botocore body has the layers ``_body_reader`` reads straight from
    (for the canary test)."""
    raw = getattr(body, "_raw_stream", None)
    return (
        isinstance(raw, urllib3.response.HTTPResponse)
        and isinstance(getattr(raw, "_fp", None), http.client.HTTPResponse)
        and getattr(raw, "_fp_bytes_read", None) == 0
    )


def _range_total(response: Mapping[str, Any], first: int, last: int, what: str) -> int:
    """The object's size from a ranged answer's Content-Range; StorageError unless the answer
    holds exactly bytes ``first``..``last`` (a server that ignored the Range, or an object
    that ends before ``last``)."""
    reached = str(response.get("ContentRange", ""))
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", reached)
    if not match or (int(match[1]), int(match[2])) != (first, last):
        raise StorageError(
            errno.EIO, f"{what}: the server answered {reached or 'the whole object'}"
        )
    return int(match[3])


__getattr__ = served_from(__name__, "ckptstore.backends.s3_open")
"""``s3_open``'s names (``open_*``, ``make_client``, ...), still served from here."""
