"""Publish by creating the manifest object only if absent (``If-None-Match: *``).

Layout under the store's prefix (DESIGN §4.3)::

    LATEST                               hint: the newest published step, moved by If-Match CAS
    manifests/step-<020d>.json           the commit point: created at most once per step
    step-<020d>.<attempt>/<shard name>   data of one attempt, at keys no other attempt uses

Shards are uploaded whole (one put) or in parts (multipart, invisible until completed) under
the attempt's own prefix, so a failed or concurrent attempt can never overwrite data that a
published manifest references. The manifest put is the single atomic, exclusive operation; an
outcome left unknown by a timeout or a refused retry of our own put is resolved by reading the
manifest back and comparing attempt ids (I8).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

from ckptstore.commit.base import CommitStrategy, GcItem, GcReport, ShardProblem, ShardSink
from ckptstore.driver import Capability, ObjectInfo, ObjectStoreDriver, PartInfo, UploadInfo
from ckptstore.errors import (
    CapabilityError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    InvalidOptionError,
    ManifestCorruptError,
    ObjectNotFoundError,
    PreconditionFailedError,
    ShardMissingError,
    StorageError,
    TransientStorageError,
)
from ckptstore.manifest import MAX_MANIFEST_BYTES, Manifest, ShardRecord
from ckptstore.names import new_attempt_id, parse_step_token, step_token

__all__ = ["ConditionalPutCommit"]

log = logging.getLogger(__name__)

MANIFESTS = "manifests/"
PROBE_PREFIX = ".ckptstore-probe-"
LATEST_KEY = "LATEST"
_MiB = 1024 * 1024
DEFAULT_PART_SIZE = 8 * _MiB
PARTS_PER_TIER = 1000
PUBLISH_TRIES = 5
CAS_TRIES = 16


def part_size_for(part_number: int, base: int) -> int:
    """Part size for part ``part_number``: doubles every 1000 parts, so 10,000 parts hold 5 TiB.

    The total size of a streamed shard is not known in advance; growing the parts lets a shard
    of any size up to 10,000 x base x 512 fit in S3's 10,000-part limit.
    """
    return int(base * 2 ** ((part_number - 1) // PARTS_PER_TIER))


class _ObjectShardSink(ShardSink):
    """Buffers a shard into parts: one put if it fits in one part, else a multipart upload.

    With ``executor``, up to ``in_flight`` parts upload concurrently; each holds its own copy
    of its bytes, so memory stays bounded by ``in_flight`` parts whatever the shard's size.
    """

    def __init__(
        self,
        driver: ObjectStoreDriver,
        key: str,
        part_size: int,
        size_hint: int | None,
        executor: ThreadPoolExecutor | None,
        in_flight: int,
    ) -> None:
        self._driver = driver
        self._key = key
        self._base = part_size
        if size_hint is not None:  # known size: fixed parts that fit the part-count limit
            needed = -(-size_hint // driver.max_parts)
            self._base = max(part_size, -(-needed // _MiB) * _MiB)
        self._fixed = size_hint is not None
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[PartInfo] = []
        self._pending: deque[Future[PartInfo]] = deque()
        self._executor = executor
        self._in_flight = max(1, in_flight)
        self._next_number = 1

    def _next_part_size(self) -> int:
        return self._base if self._fixed else part_size_for(self._next_number, self._base)

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" else data
        while view.nbytes:
            target = self._next_part_size()
            if not self._buffer and self._upload_id is not None and view.nbytes > target:
                self._upload(view[:target])  # a whole part straight from the caller's buffer
                view = view[target:]
                continue
            room = target - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if view.nbytes:  # the buffer is full and more follows: it is not the last part
                self._upload(memoryview(self._buffer))
                self._buffer = bytearray()

    def _upload(self, part: memoryview) -> None:
        if self._upload_id is None:
            self._upload_id = self._driver.create_multipart(self._key)
        number = self._next_number
        if number > self._driver.max_parts:
            raise StorageError(f"{self._key}: more than {self._driver.max_parts} parts")
        self._next_number += 1
        upload_id = self._upload_id
        if self._executor is None:
            self._parts.append(self._driver.upload_part(self._key, upload_id, number, part))
            return
        while len(self._pending) >= self._in_flight:
            self._parts.append(self._pending.popleft().result())
        body = bytes(part)  # the caller may reuse its buffer once write() returns
        self._pending.append(
            self._executor.submit(self._driver.upload_part, self._key, upload_id, number, body)
        )

    def _drain(self) -> None:
        while self._pending:
            self._parts.append(self._pending.popleft().result())

    def close(self) -> Mapping[str, str]:
        if self._upload_id is None:
            info = self._driver.put(self._key, bytes(self._buffer))
        else:
            if self._buffer or self._next_number == 1:
                self._upload(memoryview(self._buffer))
            self._drain()
            parts = sorted(self._parts, key=lambda p: p.part_number)
            info = self._driver.complete_multipart(self._key, self._upload_id, parts)
            self._upload_id = None
        self._buffer = bytearray()
        locator = {"key": self._key, "etag": info.etag}
        if info.version_id is not None:
            locator["version_id"] = info.version_id
        return locator

    def abort(self) -> None:
        self._buffer = bytearray()
        for future in self._pending:
            future.cancel()
        for future in self._pending:
            try:
                future.result()
            except Exception:  # the upload is being abandoned anyway
                log.debug("part upload of %s failed during abort", self._key, exc_info=True)
        self._pending.clear()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                self._driver.abort_multipart(self._key, upload_id)
            except StorageError:
                log.debug("aborting upload of %s failed; GC will", self._key, exc_info=True)


class ConditionalPutCommit(CommitStrategy[ObjectStoreDriver]):
    """The object-store protocol: attempt-unique data keys, manifest created if absent."""

    name = "conditional-put"
    required_capabilities = frozenset({Capability.CONDITIONAL_CREATE})
    fixed_names = frozenset({LATEST_KEY})
    verify_conditional_writes = True
    """Probe conditional create when a writer opens the store (the conformance suite turns
    this off, to measure and report storage that ckptstore would refuse)."""

    def __init__(
        self,
        driver: ObjectStoreDriver,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = 1,
    ) -> None:
        if part_size < driver.min_part_size:
            raise InvalidOptionError(
                f"part_size {part_size} is below the storage's minimum part size "
                f"{driver.min_part_size}"
            )
        if concurrency < 1:
            raise InvalidOptionError(f"concurrency must be at least 1, got {concurrency}")
        super().__init__(driver)
        self.part_size = part_size
        self.concurrency = concurrency
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def _parts_executor(self) -> ThreadPoolExecutor | None:
        if self.concurrency == 1:
            return None
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.concurrency, thread_name_prefix="ckptstore-parts"
                )
            return self._executor

    def open_root(self, *, create: bool) -> None:
        self.driver.check_bucket()
        if create and self.verify_conditional_writes:
            self._verify_conditional_create()

    def _verify_conditional_create(self) -> None:
        """Refuse storage that ignores If-None-Match on PutObject: publishing would not be
        exclusive there (I5). Three small requests, made once when a writer opens the store."""
        key = f"{PROBE_PREFIX}{new_attempt_id()}"
        first = self.driver.put(key, b"1", if_none_match=True)
        try:
            try:
                self.driver.put(key, b"2", if_none_match=True)
            except PreconditionFailedError:
                return
            raise CapabilityError(
                f"{self.url}: the storage ignored If-None-Match: * on PutObject (conditional "
                f"create). ckptstore publishes a checkpoint by creating its manifest only if "
                f"absent; without it two writers could overwrite each other's checkpoints. Use "
                f"storage with conditional writes (AWS S3, recent MinIO, SeaweedFS, ...)"
            )
        finally:  # by version id where there is one: a plain DELETE would leave the version
            self.driver.delete(key, version_id=first.version_id)

    # -- writing -------------------------------------------------------------------------

    @staticmethod
    def attempt_prefix(step: int, attempt: str) -> str:
        """The key prefix (ending in '/') under which an attempt writes its shards."""
        return f"{step_token(step)}.{attempt}/"

    @staticmethod
    def manifest_key(step: int) -> str:
        """The key of a step's manifest; its existence is the commit."""
        return f"{MANIFESTS}{step_token(step)}.json"

    def begin(self, step: int, attempt: str) -> None:
        return None  # attempt-unique keys need no preparation

    def open_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None = None
    ) -> ShardSink:
        key = f"{self.attempt_prefix(step, attempt)}{name}"
        return _ObjectShardSink(
            self.driver, key, self.part_size, size_hint, self._parts_executor(), self.concurrency
        )

    def publish(self, manifest: Manifest) -> None:
        self._check_sealed(manifest)
        key = self.manifest_key(manifest.step)
        body = manifest.encode()
        for _ in range(PUBLISH_TRIES):
            try:
                self.driver.put(key, body, if_none_match=True)
                return
            except PreconditionFailedError:
                if self._published_attempt(manifest.step) == manifest.attempt:
                    return  # an earlier try of ours took effect (I8)
                raise self._exists(manifest.step) from None
            except TransientStorageError:
                owner = self._published_attempt(manifest.step)
                if owner == manifest.attempt:
                    return
                if owner is not None:
                    raise self._exists(manifest.step) from None
                log.warning("publishing %s: outcome unknown, not published; trying again", key)
        raise TransientStorageError(
            f"{self.url}: could not publish step {manifest.step} after {PUBLISH_TRIES} tries; "
            f"nothing was published"
        )

    def _check_sealed(self, manifest: Manifest) -> None:
        """Every shard the manifest lists is stored, complete, at its locator: else no publish."""
        problems = self.shard_problems(manifest)
        if problems:
            raise ShardMissingError(
                f"{self.url}: step {manifest.step} cannot be published: "
                f"{'; '.join(map(str, problems[:5]))}"
            )

    def _exists(self, step: int) -> CheckpointExistsError:
        return CheckpointExistsError(
            f"{self.url}: step {step} is already published; the existing checkpoint was left intact"
        )

    def _published_attempt(self, step: int) -> str | None:
        try:
            data, _ = self.driver.get(self.manifest_key(step))
        except ObjectNotFoundError:
            return None
        try:
            return Manifest.decode(data, where=self.manifest_key(step)).attempt
        except IntegrityError:
            return "<unreadable>"

    def abort(self, step: int, attempt: str) -> None:
        prefix = self.attempt_prefix(step, attempt)
        for upload in list(self.driver.list_multipart_uploads(prefix)):
            self.driver.abort_multipart(upload.key, upload.upload_id)
        for info in list(self.driver.list(prefix)):
            self.driver.delete(info.key)

    # -- reading -------------------------------------------------------------------------

    def published_steps(self, min_step: int = 0) -> list[int]:
        start_after = None
        if min_step > 0:
            start_after = f"{MANIFESTS}{step_token(min_step - 1)}.json"
        steps = []
        for info in self.driver.list(MANIFESTS, start_after=start_after):
            name = info.key[len(MANIFESTS) :]
            if name.endswith(".json"):
                step = parse_step_token(name[: -len(".json")])
                if step is not None and step >= min_step:
                    steps.append(step)
        return sorted(steps)

    def is_published(self, step: int) -> bool:
        try:
            self.driver.head(self.manifest_key(step))
        except ObjectNotFoundError:
            return False
        return True

    def read_manifest(self, step: int) -> Manifest:
        key = self.manifest_key(step)
        try:
            with self.driver.open_read(key) as stream:  # one request, bounded in memory
                data = stream.read(MAX_MANIFEST_BYTES + 1)
        except ObjectNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.url}: no published checkpoint at step {step}"
            ) from exc
        manifest = Manifest.decode(data, where=f"{self.url}/{key}", expected_step=step)
        prefix = self.attempt_prefix(step, manifest.attempt)
        for record in manifest.shards:
            if record.locator.get("key") != f"{prefix}{record.name}":
                raise ManifestCorruptError(
                    f"{self.url}/{key}: shard {record.name!r} has a foreign locator "
                    f"{dict(record.locator)!r}"
                )
        return manifest

    def open_shard_reader(self, manifest: Manifest, record: ShardRecord) -> BinaryIO:
        key = record.locator["key"]
        try:
            return self.driver.open_read(key, version_id=record.locator.get("version_id"))
        except ObjectNotFoundError as exc:
            raise ShardMissingError(
                f"{self.url}: step {manifest.step}: shard {record.name!r} is missing ({key})"
            ) from exc

    def shard_problems(self, manifest: Manifest) -> list[ShardProblem]:
        prefix = self.attempt_prefix(manifest.step, manifest.attempt)
        stored: dict[str, ObjectInfo] = {i.key: i for i in self.driver.list(prefix)}
        problems: list[ShardProblem] = []
        for record in manifest.shards:
            info = stored.get(f"{prefix}{record.name}")
            if info is None:
                problems.append(ShardProblem(record.name, missing=True))
            elif info.size != record.size:
                problems.append(ShardProblem(record.name, False, info.size, record.size))
        return problems

    # -- LATEST hint ---------------------------------------------------------------------

    def _read_latest(self) -> tuple[int | None, str | None]:
        try:
            data, info = self.driver.get(LATEST_KEY)
        except ObjectNotFoundError:
            return None, None
        try:
            return int(data.decode("ascii").strip()), info.etag
        except (UnicodeDecodeError, ValueError):
            log.warning("%s/%s is unreadable; replacing the hint", self.url, LATEST_KEY)
            return None, info.etag

    def read_latest_hint(self) -> int | None:
        return self._read_latest()[0]

    def advance_latest_hint(self, step: int) -> None:
        body = f"{step}\n".encode("ascii")
        for _ in range(CAS_TRIES):
            current, etag = self._read_latest()
            if current is not None and current >= step:
                return
            try:
                if etag is None:
                    self.driver.put(LATEST_KEY, body, if_none_match=True)
                else:
                    self.driver.put(LATEST_KEY, body, if_match=etag)
                return
            except (PreconditionFailedError, ObjectNotFoundError):
                continue  # another writer moved it: re-read, and only move forward
        log.warning("%s: LATEST hint not advanced to %d (contended); readers list", self.url, step)

    def reset_latest_hint(self, step: int | None) -> None:
        if step is None:
            self.driver.delete(LATEST_KEY)
        else:
            self.driver.put(LATEST_KEY, f"{step}\n".encode("ascii"))

    # -- removal -------------------------------------------------------------------------

    def unpublish(self, step: int) -> None:
        try:
            attempt: str | None = self.read_manifest(step).attempt
        except IntegrityError:
            attempt = None  # its data is unreferenced once the manifest is gone: GC removes it
        self.driver.delete(self.manifest_key(step))
        if attempt is not None:
            for info in list(self.driver.list(self.attempt_prefix(step, attempt))):
                self.driver.delete(info.key)

    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> GcReport:
        report = GcReport(dry_run=dry_run, grace_s=grace_s)
        protected_attempts: set[str] = set()
        protected_steps: set[int] = set()
        for step in self.published_steps():
            try:
                protected_attempts.add(self.attempt_prefix(step, self.read_manifest(step).attempt))
            except CheckpointNotFoundError:
                continue
            except IntegrityError:
                protected_steps.add(step)  # unreadable manifest: keep every attempt of the step
        groups: dict[str, list[ObjectInfo]] = {}
        for info in self.driver.list(""):
            if info.key.startswith(MANIFESTS) or info.key == LATEST_KEY:
                continue
            if info.key.startswith(PROBE_PREFIX):  # left by a writer that died while opening
                self._collect_probe(report, info, now)
                continue
            head = info.key.split("/", 1)[0] + "/"
            groups.setdefault(head, []).append(info)
        uploads: dict[str, list[UploadInfo]] = {}
        for upload in self.driver.list_multipart_uploads(""):
            uploads.setdefault(upload.key.split("/", 1)[0] + "/", []).append(upload)
        for prefix in sorted(set(groups) | set(uploads)):
            prefix_step = parse_step_token(prefix.split(".", 1)[0])
            if (
                prefix_step is None
                or prefix in protected_attempts
                or prefix_step in protected_steps
            ):
                continue
            objects, pending = groups.get(prefix, []), uploads.get(prefix, [])
            newest = max([i.last_modified for i in objects], default=0.0)
            for upload in pending:  # parts uploaded lately keep an attempt alive
                if now - max(newest, upload.initiated) > report.grace_s:
                    newest = max(newest, self._upload_activity(upload))
                newest = max(newest, upload.initiated)
            item = GcItem(
                kind="attempt",
                name=prefix,
                age_s=max(0.0, now - newest),
                size=sum(i.size for i in objects),
            )
            if item.age_s <= grace_s:
                report.kept_young.append(item)
                continue
            report.removed.append(item)
            if not dry_run:
                for upload in pending:
                    self._abort_quietly(upload.key, upload.upload_id)
                for info in objects:
                    self.driver.delete(info.key)
        return report

    def _collect_probe(self, report: GcReport, info: ObjectInfo, now: float) -> None:
        item = GcItem("probe", info.key, max(0.0, now - info.last_modified), info.size)
        if item.age_s <= report.grace_s:
            report.kept_young.append(item)
            return
        report.removed.append(item)
        if not report.dry_run:
            self.driver.delete(info.key)

    def _upload_activity(self, upload: UploadInfo) -> float:
        try:
            return self.driver.upload_activity(upload)
        except ObjectNotFoundError:
            return upload.initiated  # completed or aborted meanwhile

    def _abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            self.driver.abort_multipart(key, upload_id)
        except ObjectNotFoundError:
            return  # completed or aborted meanwhile

    def stored_names(self, manifest: Manifest) -> set[str]:
        names = {self.manifest_key(manifest.step)}
        names.update(record.locator["key"] for record in manifest.shards)
        return names

    def raw_names(self) -> set[str]:
        return {info.key for info in self.driver.list("")} | self._upload_names()

    def _upload_names(self) -> set[str]:
        return {
            f"{upload.key} (upload {upload.upload_id})"
            for upload in self.driver.list_multipart_uploads("")
        }

    def _no_uploads(self) -> bool:
        return next(iter(self.driver.list_multipart_uploads("")), None) is None

    def is_empty(self) -> bool:
        return next(iter(self.driver.list("")), None) is None and self._no_uploads()
