"""A whole object-store backend on ``ObjectStoreBase``: what a new SDK's driver has to write.

``minimal://bucket/prefix`` drives an in-process storage with an SDK of its own
(``tests/minimal_service.py``), which refuses requests, loses answers and breaks bodies on
demand; the base carries the retries, the read-back of a lost create, the resumed reads and
the translation of the service's errors (its table: ``ANSWERS`` and ``RULES``).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, cast

from minimal_service import MinimalService, ServiceError, Stored

from ckptstore.backends.error_table import AnswerTable, Rules, broken, translating
from ckptstore.backends.object_store import (
    S3_LIKE,
    ObjectReplacedError,
    ObjectStoreBase,
    PutRequest,
)
from ckptstore.backends.resuming_reader import ResumingReader
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.driver import (
    Buffer,
    ObjectInfo,
    PartInfo,
    PutMode,
    UploadInfo,
    UploadProgress,
)
from ckptstore.errors import ObjectNotFoundError, PreconditionFailedError
from ckptstore.urls import StoreURL

ANSWERS = AnswerTable(
    store_missing="{what}: bucket {store!r} does not exist",
    not_found=frozenset({"NoSuchKey", "NoSuchUpload"}),
    transient=frozenset({"SlowDown"}),
)


def _answer(exc: BaseException, what: str, store: str) -> Exception:
    error = cast(ServiceError, exc)
    return ANSWERS.error(what, store, code=error.code, status=error.status, reason="")


RULES: Rules = (
    (ServiceError, _answer),  # type: ignore[list-item]
    (ConnectionError, lambda exc, what, _: broken(what, exc, timeout=False)),
)


class MinimalDriver(ObjectStoreBase):
    """The driver: only what this service's SDK makes different."""

    scheme = "minimal"
    rules = RULES
    max_parts = 10_000
    min_part_size = 1
    capabilities = S3_LIKE
    process_local = True  # the service lives in this process: no other process reaches it

    def __init__(self, service: MinimalService, bucket: str, prefix: str) -> None:
        super().__init__(bucket, prefix, url=None, max_attempts=5, max_delay_s=10.0)
        self.service = service

    def _info(self, key: str, stored: Stored) -> ObjectInfo:
        return ObjectInfo(key, len(stored[0]), stored[1], stored[2], metadata=stored[3])

    def probe_bucket(self) -> tuple[str, Callable[[], object]]:
        return "LIST", lambda: self.service.list("", "")

    def put_request(
        self, key: str, body: bytes, mode: PutMode, metadata: Mapping[str, str] | None
    ) -> PutRequest:
        def send() -> ObjectInfo:
            etag = self.service.put(self.full(key), body, mode, metadata or {})
            return ObjectInfo(key, len(body), etag, time.time())

        return PutRequest(f"PUT {key} ({mode.kind})", send)

    def _open(self, key: str, *, retried: bool) -> ResumingReader:
        call = self.retried if retried else self.once
        body, stored = call(f"GET {key}", lambda: self.service.get(self.full(key)))

        def reopen(position: int) -> Any:  # the rest, from the same object only
            try:
                return self.retried(
                    f"GET {key} from {position}",
                    lambda: self.service.get(self.full(key), position, stored[1])[0],
                )
            except (PreconditionFailedError, ObjectNotFoundError) as exc:
                raise ObjectReplacedError(errno.ESTALE, f"{key}: replaced while read") from exc

        what = f"reading {key}"
        return ResumingReader(
            body,
            self._info(key, stored),
            size=len(stored[0]),
            what=what,
            pinned=True,
            max_attempts=self.max_attempts,
            reopen=reopen,
            translate=lambda: translating(self.rules, what, self.bucket_name),
        )

    def read_whole(self, key: str, version_id: str | None) -> tuple[bytes, ObjectInfo]:
        def read() -> tuple[bytes, ObjectInfo]:
            with self._open(key, retried=False) as stream:
                return stream.read(), stream.info

        return self.retrying(read)

    def open_read(self, key: str, *, version_id: str | None = None) -> BinaryIO:
        return cast(BinaryIO, self._open(key, retried=True))

    def head(self, key: str, *, version_id: str | None = None) -> ObjectInfo:
        return self._info(
            key, self.retried(f"HEAD {key}", lambda: self.service.head(self.full(key)))
        )

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        self.retried(f"DELETE {key}", lambda: self.service.delete(self.full(key)))

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        after = self.full(start_after) if start_after is not None else ""
        listing = self.pages(
            f"LIST {prefix}", lambda marker: self.service.list(self.full(prefix), marker or after)
        )
        for name, stored in listing:
            yield self._info(self.relative(name), stored)

    def list_versions(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.list(prefix)

    def create_multipart(self, key: str, *, metadata: Mapping[str, str] | None = None) -> str:
        return self.once(
            f"CREATE UPLOAD {key}",
            lambda: self.service.create_upload(self.full(key), metadata or {}),
        )

    def upload_part(self, key: str, upload_id: str, part_number: int, data: Buffer) -> PartInfo:
        body = bytes(data)
        self.retried(
            f"PART {key} #{part_number}",
            lambda: self.service.put_part(upload_id, part_number, body),
        )
        return PartInfo(part_number, str(part_number), len(body))

    def complete(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create: bool
    ) -> ObjectInfo:
        numbers = [part.part_number for part in parts]
        etag = self.once(
            f"COMPLETE {key}", lambda: self.service.complete(upload_id, numbers, create)
        )
        return ObjectInfo(key, sum(part.size for part in parts), etag, time.time())

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.retried(f"ABORT {key}", lambda: self.service.abort(upload_id))

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        for upload_id, upload in self.retried(
            "UPLOADS", lambda: self.service.list_uploads(self.full(prefix))
        ):
            yield UploadInfo(self.relative(upload[0]), upload_id, upload[1])

    def upload_progress(self, upload: UploadInfo) -> UploadProgress:
        parts = self.retried("PARTS", lambda: dict(self.service.upload(upload.upload_id)[2]))
        return UploadProgress(upload.initiated, sum(map(len, parts.values())), len(parts))


SERVICES: dict[str, MinimalService] = {}


def open_minimal(url: StoreURL, options: Mapping[str, object]) -> ConditionalPutCommit:
    """``minimal://bucket/prefix``: the process's service of that bucket, 1 KiB parts."""
    url.reject_unknown(options, allowed=())
    service = SERVICES.setdefault(url.netloc, MinimalService())
    return ConditionalPutCommit(MinimalDriver(service, url.netloc, url.path), part_size=1024)
