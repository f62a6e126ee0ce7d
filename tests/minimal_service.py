"""An in-process object storage with an SDK of its own (its errors, pages and bodies), standing
in for a cloud service and its client library: what ``tests/minimal_object_store.py`` drives.

It can refuse requests (503, before any effect), lose answers (after the effect) and break
response bodies, on demand: the faults a real network makes.
"""

from __future__ import annotations

import errno
import io
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from ckptstore.driver import PutMode

Stored = tuple[bytes, str, float, Mapping[str, str]]
"""An object: its bytes, ETag, time and user metadata."""
Upload = tuple[str, float, dict[int, bytes], Mapping[str, str]]
"""An upload: its object's name, start, parts and metadata."""


class ServiceError(Exception):
    """The service's error answer: an HTTP status and a code."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"{status} {code}")
        self.status, self.code = status, code


class Body(io.BytesIO):
    """A response body that breaks (once) at ``breaks_at``."""

    def __init__(self, data: bytes, breaks_at: int | None) -> None:
        super().__init__(data)
        self.breaks_at = breaks_at

    def read(self, size: int | None = -1) -> bytes:
        if self.breaks_at is not None and self.tell() >= self.breaks_at:
            raise ConnectionResetError(errno.ECONNRESET, "the body broke")
        end = len(self.getbuffer()) if self.breaks_at is None else self.breaks_at
        left = end - self.tell()
        return super().read(left if size is None or size < 0 else min(size, left))

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(view.nbytes)
        view[: len(data)] = data
        return len(data)


class MinimalService:
    """The storage, and the faults to inject: how many requests to refuse (503, before any
    effect), how many answers to lose (after the effect), how many bodies to break."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, Stored] = {}
        self.uploads: dict[str, Upload] = {}
        self.refuse = self.lose_answers = self.break_bodies = 0
        self.serial = itertools.count(1)

    def _request(self, apply: Callable[[], Any]) -> Any:
        with self.lock:
            if self.refuse:
                self.refuse -= 1
                raise ServiceError(503, "SlowDown")
            result = apply()
            if self.lose_answers:
                self.lose_answers -= 1
                raise ConnectionResetError(errno.ECONNRESET, "the answer was lost")
            return result

    def _object(self, name: str, if_match: str | None = None) -> Stored:
        if name not in self.objects:
            raise ServiceError(404, "NoSuchKey")
        if if_match is not None and self.objects[name][1] != if_match:
            raise ServiceError(412, "PreconditionFailed")
        return self.objects[name]

    def _store(self, name: str, data: bytes, create: bool, metadata: Mapping[str, str]) -> str:
        if create and name in self.objects:
            raise ServiceError(412, "PreconditionFailed")
        self.objects[name] = (data, f'"{next(self.serial)}"', time.time(), dict(metadata))
        return self.objects[name][1]

    def put(self, name: str, data: bytes, mode: PutMode, metadata: Mapping[str, str]) -> str:
        if mode.etag:
            return str(self._request(lambda: self._object(name, mode.etag) and self._store(
                name, data, False, metadata)))  # fmt: skip
        return str(self._request(lambda: self._store(name, data, mode.kind == "create", metadata)))

    def get(self, name: str, start: int = 0, if_match: str | None = None) -> tuple[Body, Stored]:
        stored: Stored = self._request(lambda: self._object(name, if_match))
        breaks = (len(stored[0]) - start) // 2 if self.break_bodies else None
        self.break_bodies -= 1 if self.break_bodies else 0
        return Body(stored[0][start:], breaks), stored

    def head(self, name: str) -> Stored:
        return cast(Stored, self._request(lambda: self._object(name)))

    def delete(self, name: str) -> None:
        self._request(lambda: self.objects.pop(name, None))

    def list(self, prefix: str, after: str) -> tuple[list[tuple[str, Stored]], str | None]:
        """A page of (at most 100) objects after ``after``, and the marker of the next."""
        found = self._request(lambda: sorted(i for i in self.objects.items() if i[0] > after))
        page = [(name, stored) for name, stored in found if name.startswith(prefix)][:100]
        return page, page[-1][0] if len(page) == 100 else None

    def create_upload(self, name: str, metadata: Mapping[str, str]) -> str:
        upload_id = f"upload-{next(self.serial)}"
        self._request(lambda: self.uploads.setdefault(upload_id, (name, time.time(), {}, metadata)))
        return upload_id

    def upload(self, upload_id: str) -> Upload:
        if upload_id not in self.uploads:
            raise ServiceError(404, "NoSuchUpload")
        return self.uploads[upload_id]

    def put_part(self, upload_id: str, number: int, data: bytes) -> None:
        self._request(lambda: self.upload(upload_id)[2].__setitem__(number, data))

    def complete(self, upload_id: str, numbers: Sequence[int], create: bool) -> str:
        def apply() -> str:
            name, _, parts, metadata = self.upload(upload_id)
            etag = self._store(name, b"".join(parts[n] for n in numbers), create, metadata)
            del self.uploads[upload_id]
            return etag

        return str(self._request(apply))

    def abort(self, upload_id: str) -> None:
        self._request(lambda: self.upload(upload_id) and self.uploads.pop(upload_id))

    def list_uploads(self, prefix: str) -> list[tuple[str, Upload]]:
        found = self._request(lambda: [(i, u) for i, u in self.uploads.items()])
        return sorted(((i, u) for i, u in found if u[0].startswith(prefix)), key=lambda f: f[1][:2])
