"""``fsspec+s3://`` on s3fs: the generic fsspec driver, with S3's own calls where fsspec has none.

s3fs exposes botocore's S3 calls (``call_s3``), so shards go up as real S3 multipart uploads
to attempt-unique keys: a crash mid-upload leaves an incomplete upload that GC lists, ages by
its parts and aborts, as on ``s3://``. Listings and HEADs are S3's own too: s3fs's ``find``
shows a key ending in '/' (a directory marker someone else made) as a directory, and its
``info`` drops the user metadata. The commit point stays ``pipe_file(mode="create")``
(``PutObject If-None-Match: *``), and there is still no compare-and-swap: fsspec's API, which
the rest of the driver uses, has none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ckptstore.backends.fsspec import FsspecDriver, object_time
from ckptstore.driver import (
    Buffer,
    Capability,
    ObjectInfo,
    PartInfo,
    UploadInfo,
    UploadProgress,
)
from ckptstore.errors import ObjectNotFoundError

__all__ = ["S3_MIN_PART_SIZE", "S3fsDriver"]

S3_MIN_PART_SIZE = 5 * 1024 * 1024


class S3fsDriver(FsspecDriver):
    """FsspecDriver on s3fs's ``S3FileSystem``: S3 multipart uploads, ListObjectsV2, HeadObject."""

    default_min_part_size = S3_MIN_PART_SIZE
    extra_capabilities = frozenset({Capability.MULTIPART})
    parts_in_order = False  # S3's own multipart uploads
    pages_listings = True  # ListObjectsV2 is called here, MaxKeys and all
    metadata_argument = "Metadata"
    names_keep_control_characters = True

    def _split(self, key: str) -> tuple[str, str]:
        """Bucket and full S3 key of a key under the store's root."""
        bucket, _, full = self._path(key).lstrip("/").partition("/")
        return bucket, full

    def _upload_args(self, key: str, upload_id: str) -> dict[str, Any]:
        bucket, full = self._split(key)
        return {"Bucket": bucket, "Key": full, "UploadId": upload_id}

    def check_bucket(self) -> None:
        """HeadBucket: s3fs's ``exists`` answers False for any error, bad credentials too."""
        try:
            found = self.retried(
                f"HeadBucket {self.bucket}",
                lambda: bool(self.fs.call_s3("head_bucket", Bucket=self.bucket)),
            )
        except ObjectNotFoundError:
            found = False
        self._bucket_found(found)

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        self._no_versions(version_id)
        bucket, full = self._split(key)
        answer = self.retried(
            f"HeadObject {key}",
            lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=full),
            key=key,
        )
        return self._info(key, {**answer, "size": answer.get("ContentLength", 0)})

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        bucket, full = self._split(prefix)
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": full}
        if start_after is not None:
            args["StartAfter"] = self._split(start_after)[1]
        if self.list_page_size:
            args["MaxKeys"] = self.list_page_size
        while True:
            page = self.retried(
                f"ListObjectsV2 {prefix}", lambda: self.fs.call_s3("list_objects_v2", **args)
            )
            for item in page.get("Contents", []):
                key = self._relative(f"{bucket}/{item['Key']}")
                yield self._info(key, {**item, "size": item.get("Size", 0)})
            if not page.get("IsTruncated"):
                return
            args["ContinuationToken"] = page["NextContinuationToken"]

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        self._writable(f"uploading {key}")
        bucket, full = self._split(key)
        args: dict[str, Any] = {"Bucket": bucket, "Key": full}
        if metadata:
            args["Metadata"] = dict(metadata)
        response = self.retried(
            f"CreateMultipartUpload {key}",
            lambda: self.fs.call_s3("create_multipart_upload", **args),
            key=key,
        )
        return str(response["UploadId"])

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        args = {**self._upload_args(key, upload_id), "PartNumber": part_number,
                "Body": bytes(data)}  # fmt: skip
        response = self.retried(
            f"UploadPart {key} #{part_number}",
            lambda: self.fs.call_s3("upload_part", **args),
            key=key,
        )
        return PartInfo(part_number, str(response["ETag"]), len(data))

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        """CompleteMultipartUpload, once: a retry after a lost answer finds no upload; the
        protocol reads back (I8). A create sends ``If-None-Match: *``."""
        args = self._upload_args(key, upload_id)
        args["MultipartUpload"] = {
            "Parts": [{"PartNumber": p.part_number, "ETag": p.etag} for p in parts]
        }
        what = f"CompleteMultipartUpload {key}"

        def send() -> object:
            return self.fs.call_s3("complete_multipart_upload", **args)

        if create:
            args["IfNoneMatch"] = "*"
            self._create_once(what, key, send)
        else:
            self.once(what, send, key=key)
        return self.head(key)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        args = self._upload_args(key, upload_id)
        self.retried(
            f"AbortMultipartUpload {key}",
            lambda: self.fs.call_s3("abort_multipart_upload", **args),
            key=key,
        )

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        bucket, full = self._split(prefix)
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": full}
        while True:
            page = self.retried(
                "ListMultipartUploads", lambda: self.fs.call_s3("list_multipart_uploads", **args)
            )
            for upload in page.get("Uploads", []):
                yield UploadInfo(
                    key=self._relative(f"{bucket}/{upload['Key']}"),
                    upload_id=str(upload["UploadId"]),
                    initiated=object_time(upload.get("Initiated")),
                )
            if not page.get("IsTruncated"):
                return
            args["KeyMarker"] = page.get("NextKeyMarker", "")
            args["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        args: dict[str, Any] = self._upload_args(upload.key, upload.upload_id)
        newest, size, count = upload.initiated, 0, 0
        while True:
            page = self.retried(
                f"ListParts {upload.key}", lambda: self.fs.call_s3("list_parts", **args)
            )
            for part in page.get("Parts", []):
                newest = max(newest, object_time(part.get("LastModified")))
                size += int(part.get("Size", 0))
                count += 1
            if not page.get("IsTruncated"):
                return UploadProgress(last_activity=newest, size=size, parts=count)
            args["PartNumberMarker"] = page.get("NextPartNumberMarker", 0)
