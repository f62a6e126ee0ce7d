"""S3 driver on boto3: ``s3://bucket/prefix``, committed by a conditional put (DESIGN §4.3).

Works with AWS S3 and S3-compatible systems (``endpoint_url``). Shards go to attempt-unique
keys, as single puts or as multipart uploads whose parts upload concurrently, each with its
CRC32C sent as an S3 additional checksum; the manifest is published with ``If-None-Match: *``.
Idempotent calls are retried on transient errors with bounded exponential backoff and jitter
(tenacity); conditional writes are never retried blindly: their unknown outcomes surface as
``IndeterminateOutcomeError`` and the protocol reads back (I8).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, BinaryIO, TypeVar, cast

import boto3
from botocore.config import Config
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from ckptstore.backends.s3_errors import translate_s3_errors
from ckptstore.checksum import crc32c_of
from ckptstore.commit.conditional_put import DEFAULT_PART_SIZE, ConditionalPutCommit
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.driver import Buffer, Capability, ObjectInfo, PartInfo, UploadInfo
from ckptstore.errors import (
    InvalidOptionError,
    InvalidURLError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    StoreNotFoundError,
    TransientStorageError,
)
from ckptstore.urls import StoreURL, option_bool, option_int

__all__ = ["S3Driver", "install_abort_incomplete_uploads_rule", "open_s3", "open_s3_versioned"]

log = logging.getLogger(__name__)

S3_MIN_PART_SIZE = 5 * 1024 * 1024
S3_MAX_PARTS = 10_000
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
T = TypeVar("T")

URL_OPTIONS = (
    "endpoint_url",
    "region",
    "profile",
    "addressing_style",
    "sse",
    "sse_kms_key_id",
    "concurrency",
    "part_size",
    "min_part_size",
    "max_attempts",
    "checksums",
    "connect_timeout",
    "read_timeout",
)
CREDENTIAL_OPTIONS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
_CLIENT_OPTIONS = frozenset(
    {"endpoint_url", "region", "profile", "addressing_style", "concurrency", "connect_timeout",
     "read_timeout", *CREDENTIAL_OPTIONS}
)  # fmt: skip


def _crc32c_b64(data: Buffer) -> str:
    return base64.b64encode(crc32c_of(data).to_bytes(4, "big")).decode("ascii")


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


def _timestamp(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else time.time()


class S3Driver:
    """Object-store primitives on one S3 bucket under a key prefix, through a boto3 client."""

    max_parts = S3_MAX_PARTS

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        min_part_size: int = S3_MIN_PART_SIZE,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        checksums: bool = True,
        max_attempts: int = 6,
        max_delay_s: float = 60.0,
        versioned: bool = False,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = url or f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.min_part_size = min_part_size
        self.checksums = checksums
        self._encryption: dict[str, str] = {}
        if sse:
            self._encryption["ServerSideEncryption"] = sse
        if sse_kms_key_id:
            self._encryption["SSEKMSKeyId"] = sse_kms_key_id
        self._retrying = Retrying(
            retry=retry_if_exception_type(TransientStorageError),
            stop=stop_after_attempt(max_attempts) | stop_after_delay(max_delay_s),
            wait=wait_exponential(multiplier=0.05, max=5.0) + wait_random(0, 0.1),
            reraise=True,
            before_sleep=lambda state: log.debug("retrying S3 call: %s", state.outcome),
        )
        self._quote_etags = True
        self.capabilities = frozenset(
            {
                Capability.CONDITIONAL_CREATE,
                Capability.COMPARE_AND_SWAP,
                Capability.MULTIPART,
                Capability.STRONG_LIST_AFTER_WRITE,
                *([Capability.VERSIONING] if versioned else []),
            }
        )

    # -- plumbing ------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.prefix + key

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) :]

    def _once(self, what: str, call: Callable[[], T]) -> T:
        with translate_s3_errors(f"{what} s3://{self.bucket}", bucket=self.bucket):
            return call()

    def _retried(self, what: str, call: Callable[[], T]) -> T:
        result: T = self._retrying(self._once, what, call)
        return result

    def _info(self, key: str, response: Mapping[str, Any], size: int) -> ObjectInfo:
        return ObjectInfo(
            key=key,
            size=int(response.get("ContentLength", size)),
            etag=str(response.get("ETag", "")),
            last_modified=_timestamp(response.get("LastModified")),
            version_id=_version(response.get("VersionId")),
        )

    # -- the driver interface ------------------------------------------------------------

    def check_bucket(self) -> None:
        once = Retrying(
            retry=retry_if_exception_type(TransientStorageError),
            stop=stop_after_attempt(2),
            wait=wait_exponential(multiplier=0.2, max=1.0) + wait_random(0, 0.1),
            reraise=True,
        )
        try:
            once(self._once, "HeadBucket", lambda: self.client.head_bucket(Bucket=self.bucket))
        except ObjectNotFoundError as exc:  # HeadBucket answers a bare 404, without a code
            raise StoreNotFoundError(
                f"{self.url}: bucket {self.bucket!r} does not exist (ckptstore never creates "
                f"buckets; create it, or check the name, region and endpoint)"
            ) from exc

    def put(
        self,
        key: str,
        data: Buffer,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> ObjectInfo:
        body = bytes(data)
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key), "Body": body}
        args.update(self._encryption)
        if self.checksums:
            args["ChecksumCRC32C"] = _crc32c_b64(body)
        if if_none_match:
            args["IfNoneMatch"] = "*"
        if if_match is None and not if_none_match:
            response = self._retried(f"PutObject {key}", lambda: self.client.put_object(**args))
            return self._info(key, response, len(body))
        if if_match is not None:
            return self._put_if_match(key, args, if_match, len(body))
        response = self._once(
            f"PutObject {key} (If-None-Match)", lambda: self.client.put_object(**args)
        )
        return self._info(key, response, len(body))

    def _put_if_match(self, key: str, args: dict[str, Any], etag: str, size: int) -> ObjectInfo:
        """PutObject If-Match, working around servers that reject one of the ETag quotings."""
        bare = etag.strip('"')
        for quoted in (self._quote_etags, not self._quote_etags):
            args["IfMatch"] = f'"{bare}"' if quoted else bare
            try:
                response = self._once(
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
        raise PreconditionFailedError(412, f"{self.url}/{key}: If-Match refused in both quotings")

    def get(self, key: str, *, version_id: str | None = None) -> tuple[bytes, ObjectInfo]:
        def call() -> tuple[bytes, ObjectInfo]:
            response = self.client.get_object(**self._object_args(key, version_id))
            with response["Body"] as body:
                data = body.read()
            return data, self._info(key, response, len(data))

        return self._retried(f"GetObject {key}", call)

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        response = self._retried(
            f"GetObject {key}", lambda: self.client.get_object(**self._object_args(key, version_id))
        )
        where = f"reading s3://{self.bucket}/{self._full(key)}"
        return cast(BinaryIO, _TranslatedStream(response["Body"], where, self.bucket))

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        response = self._retried(
            f"HeadObject {key}",
            lambda: self.client.head_object(**self._object_args(key, version_id)),
        )
        return self._info(key, response, 0)

    def _object_args(self, key: str, version_id: str | None) -> dict[str, Any]:
        args = {"Bucket": self.bucket, "Key": self._full(key)}
        if version_id is not None:
            args["VersionId"] = version_id
        return args

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        self._retried(
            f"DeleteObject {key}",
            lambda: self.client.delete_object(**self._object_args(key, version_id)),
        )

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._full(prefix)}
        if start_after is not None:
            args["StartAfter"] = self._full(start_after)
        for page in self._pages("list_objects_v2", args):
            for item in page.get("Contents", []):
                yield ObjectInfo(
                    key=self._relative(item["Key"]),
                    size=int(item["Size"]),
                    etag=str(item.get("ETag", "")),
                    last_modified=_timestamp(item.get("LastModified")),
                )

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        args = {"Bucket": self.bucket, "Prefix": self._full(prefix)}
        for page in self._pages("list_object_versions", args):
            entries = [(item, False) for item in page.get("Versions", [])]
            entries += [(item, True) for item in page.get("DeleteMarkers", [])]
            for item, marker in entries:
                yield ObjectInfo(
                    key=self._relative(item["Key"]),
                    size=int(item.get("Size", 0)),
                    etag=str(item.get("ETag", "")),
                    last_modified=_timestamp(item.get("LastModified")),
                    version_id=_version(item.get("VersionId")),
                    is_delete_marker=marker,
                    is_latest=bool(item.get("IsLatest")),
                )

    def _pages(self, operation: str, args: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Every page of a listing; each page request is retried on its own.

        (A botocore paginator cannot be resumed after an error: retrying ``next`` on it would
        end the listing early, and a short listing would mislead GC and discovery.)
        """
        markers = _PAGE_MARKERS[operation]
        call = getattr(self.client, operation)
        request = dict(args)
        while True:
            page: dict[str, Any] = self._retried(operation, lambda: call(**request))
            yield page
            if not page.get("IsTruncated"):
                return
            following = {ask: page[given] for ask, given in markers if page.get(given)}
            if not following or all(request.get(k) == v for k, v in following.items()):
                raise StorageError(
                    f"{self.url}: {operation} says the listing is truncated but gives no new "
                    f"marker to continue from ({following or 'none'})"
                )
            request.update(following)

    def create_multipart(self, key: str) -> str:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key)}
        args.update(self._encryption)
        if self.checksums:
            args["ChecksumAlgorithm"] = "CRC32C"
        response = self._retried(
            f"CreateMultipartUpload {key}", lambda: self.client.create_multipart_upload(**args)
        )
        return str(response["UploadId"])

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        body = bytes(data)
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self._full(key),
            "UploadId": upload_id,
            "PartNumber": part_number,
            "Body": body,
        }
        checksum = _crc32c_b64(body) if self.checksums else None
        if checksum:
            args["ChecksumCRC32C"] = checksum
        response = self._retried(
            f"UploadPart {key} #{part_number}", lambda: self.client.upload_part(**args)
        )
        return PartInfo(part_number, str(response["ETag"]), len(body), checksum)

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, if_none_match: bool = False
    ) -> ObjectInfo:
        listed = []
        for part in parts:
            entry: dict[str, Any] = {"PartNumber": part.part_number, "ETag": part.etag}
            if part.checksum_crc32c and self.checksums:
                entry["ChecksumCRC32C"] = part.checksum_crc32c
            listed.append(entry)
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self._full(key),
            "UploadId": upload_id,
            "MultipartUpload": {"Parts": listed},
        }
        if if_none_match:
            args["IfNoneMatch"] = "*"
        what = f"CompleteMultipartUpload {key}"
        size = sum(part.size for part in parts)
        if if_none_match:
            response = self._once(what, lambda: self.client.complete_multipart_upload(**args))
        else:
            response = self._complete_idempotently(what, key, args)
        # botocore turns a 200 response with an embedded <Error> into an error; an answer
        # without an ETag is refused too, rather than taken for success.
        if not response.get("ETag"):
            raise StorageError(errno.EIO, f"{what}: the answer has no ETag: {response!r}")
        return self._info(key, response, size)

    def _complete_idempotently(self, what: str, key: str, args: dict[str, Any]) -> dict[str, Any]:
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
            return self._retried(what, call)
        except ObjectNotFoundError:
            if not tried:
                raise
            info = self.head(key)  # keys are attempt-unique: an object there is ours
            return {"ETag": info.etag, "ContentLength": info.size, "VersionId": info.version_id}

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._retried(
            f"AbortMultipartUpload {key}",
            lambda: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self._full(key), UploadId=upload_id
            ),
        )

    def bucket_versioning(self) -> str:
        response = self._retried(
            "GetBucketVersioning", lambda: self.client.get_bucket_versioning(Bucket=self.bucket)
        )
        return str(response.get("Status", ""))

    def upload_activity(self, upload: UploadInfo) -> float:
        args = {
            "Bucket": self.bucket,
            "Key": self._full(upload.key),
            "UploadId": upload.upload_id,
        }
        newest = upload.initiated
        for page in self._pages("list_parts", args):
            for part in page.get("Parts", []):
                newest = max(newest, _timestamp(part.get("LastModified")))
        return newest

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        args = {"Bucket": self.bucket, "Prefix": self._full(prefix)}
        for page in self._pages("list_multipart_uploads", args):
            for upload in page.get("Uploads", []):
                yield UploadInfo(
                    key=self._relative(upload["Key"]),
                    upload_id=str(upload["UploadId"]),
                    initiated=_timestamp(upload.get("Initiated")),
                )


def _version(value: Any) -> str | None:
    return None if value in (None, "", "null") else str(value)


class _TranslatedStream:
    """A GetObject body whose read errors are ckptstore errors."""

    def __init__(self, body: Any, what: str, bucket: str) -> None:
        self._body = body
        self._what = what
        self._bucket = bucket

    def read(self, size: int = -1) -> bytes:
        with translate_s3_errors(self._what, bucket=self._bucket):
            data: bytes = self._body.read(None if size < 0 else size)
            return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(view.nbytes)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> _TranslatedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_clients: dict[tuple[tuple[str, str], ...], Any] = {}
_clients_lock = threading.Lock()


def make_client(options: Mapping[str, object]) -> Any:
    """A boto3 S3 client from options, shared by stores opened with the same options.

    Credentials come from boto3's standard chain unless given explicitly. botocore's own
    retries are off: ckptstore retries (tenacity) only what is safe to retry.
    """
    key = tuple(sorted((k, str(v)) for k, v in options.items() if k in _CLIENT_OPTIONS))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = _new_client(options)
        return client


def _new_client(options: Mapping[str, object]) -> Any:
    addressing = str(options.get("addressing_style", "auto"))
    if addressing not in ("auto", "path", "virtual"):
        raise InvalidOptionError(
            f"addressing_style must be auto, path or virtual, not {addressing}"
        )
    config = Config(
        s3={"addressing_style": addressing},
        retries={"max_attempts": 1, "mode": "standard"},
        connect_timeout=option_int(options, "connect_timeout", 5, minimum=1),
        read_timeout=option_int(options, "read_timeout", 60, minimum=1),
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        max_pool_connections=max(10, option_int(options, "concurrency", 8, minimum=1) + 2),
    )
    session = boto3.session.Session(
        profile_name=str(options["profile"]) if options.get("profile") else None,
        region_name=str(options["region"]) if options.get("region") else None,
        **{k: str(options[k]) for k in CREDENTIAL_OPTIONS if options.get(k)},
    )
    endpoint = str(options["endpoint_url"]) if options.get("endpoint_url") else None
    return session.client("s3", endpoint_url=endpoint, config=config)


def parse_location(url: StoreURL) -> tuple[str, str]:
    """Bucket and prefix of an s3:// URL, validated."""
    bucket = url.netloc
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise InvalidURLError(f"{url.raw}: {bucket!r} is not a valid S3 bucket name")
    return bucket, url.path.strip("/")


def open_s3(url: StoreURL, options: Mapping[str, object]) -> ConditionalPutCommit:
    """Open an ``s3://bucket/prefix`` store: S3Driver + ConditionalPutCommit."""
    driver, part_size, concurrency = _s3_driver(url, options, versioned=False)
    return ConditionalPutCommit(driver, part_size=part_size, concurrency=concurrency)


def open_s3_versioned(url: StoreURL, options: Mapping[str, object]) -> VersionPinCommit:
    """Open an ``s3+versioned://bucket/prefix`` store: S3Driver + VersionPinCommit.

    The bucket must have versioning enabled; opening checks and refuses otherwise.
    """
    driver, part_size, concurrency = _s3_driver(url, options, versioned=True)
    return VersionPinCommit(driver, part_size=part_size, concurrency=concurrency)


def _s3_driver(
    url: StoreURL, options: Mapping[str, object], *, versioned: bool
) -> tuple[S3Driver, int, int]:
    leaked = sorted(set(url.query) & set(CREDENTIAL_OPTIONS))
    if leaked:
        raise InvalidOptionError(
            f"credentials ({', '.join(leaked)}) do not belong in a URL, where they end up in "
            f"logs; pass them as keyword arguments or through the AWS credential chain"
        )
    url.reject_unknown(options, allowed=URL_OPTIONS + CREDENTIAL_OPTIONS)
    bucket, prefix = parse_location(url)
    min_part_size = option_int(options, "min_part_size", S3_MIN_PART_SIZE, minimum=1)
    driver = S3Driver(
        make_client(options),
        bucket,
        prefix,
        url=f"{url.scheme}://{bucket}/{prefix}".rstrip("/"),
        min_part_size=min_part_size,
        sse=str(options["sse"]) if options.get("sse") else None,
        sse_kms_key_id=str(options["sse_kms_key_id"]) if options.get("sse_kms_key_id") else None,
        checksums=option_bool(options, "checksums", True),
        max_attempts=option_int(options, "max_attempts", 6, minimum=1),
        versioned=versioned,
    )
    part_size = option_int(options, "part_size", max(DEFAULT_PART_SIZE, min_part_size), minimum=1)
    return driver, part_size, option_int(options, "concurrency", 8, minimum=1)


def install_abort_incomplete_uploads_rule(
    url: str, *, days: int = 7, **options: object
) -> dict[str, Any]:
    """Add (or replace) the bucket lifecycle rule that aborts incomplete multipart uploads
    under the store's prefix after ``days``; other rules are kept. Returns the rule."""
    from ckptstore.urls import parse_url

    parsed = parse_url(url)
    if parsed.scheme not in ("s3", "s3+versioned"):
        raise InvalidURLError(f"{url}: lifecycle rules apply to s3:// stores")
    bucket, prefix = parse_location(parsed)
    client = make_client({**parsed.query, **options})
    rule_id = f"ckptstore-abort-incomplete-uploads-{hashlib.sha1(prefix.encode()).hexdigest()[:10]}"
    rule = {
        "ID": rule_id,
        "Status": "Enabled",
        "Filter": {"Prefix": f"{prefix}/" if prefix else ""},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": days},
    }
    what = f"lifecycle of s3://{bucket}"
    try:
        with translate_s3_errors(f"GetBucketLifecycleConfiguration {what}", bucket=bucket):
            rules = client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
    except StorageError as exc:
        if "NoSuchLifecycleConfiguration" not in str(exc):
            raise
        rules = []
    rules = [r for r in rules if r.get("ID") != rule_id] + [rule]
    with translate_s3_errors(f"PutBucketLifecycleConfiguration {what}", bucket=bucket):
        client.put_bucket_lifecycle_configuration(
            Bucket=bucket, LifecycleConfiguration={"Rules": rules}
        )
    return rule
