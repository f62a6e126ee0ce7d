"""Publish a manifest that pins object versions: stable shard keys on a versioned bucket.

Layout under the store's prefix (docs/backends/versioned.md)::

    LATEST                           hint, moved by If-Match CAS (old versions are GC'd)
    manifests/step-<020d>.json       the commit point: created at most once per step
    shards/<shard name>              stable keys; every write adds a version

Users with fixed key layouts keep their keys; every write returns a VersionId, and the
manifest pins ``(key, VersionId)`` for each shard. Readers read by VersionId, so a later write
of the same key (the next step, another attempt, a foreign writer) never changes a byte of a
published checkpoint. Deletion deletes *versions*, by id: a plain DELETE only adds a delete
marker, which hides an object but frees nothing. A pinned version that is gone (deleted or
expired behind ckptstore's back) makes that checkpoint damaged; it is never read as another
version of its key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

from ckptstore.commit.base import GcItem, GcReport, ShardProblem, ShardSink
from ckptstore.commit.blob_leases import BLOBS, LIVE, parse_blob_key
from ckptstore.commit.conditional_put import (
    LATEST_KEY,
    MANIFESTS,
    PROBE_PREFIX,
    ConditionalPutCommit,
    ObjectShardSink,
    _blob_locator_problem,
)
from ckptstore.driver import Capability, ObjectInfo
from ckptstore.errors import (
    CapabilityError,
    CheckpointNotFoundError,
    IntegrityError,
    ObjectNotFoundError,
)
from ckptstore.manifest import Manifest, ShardRecord
from ckptstore.names import parse_attempt_name, parse_checkpoint_token, step_token

__all__ = ["VersionPinCommit", "versioned_name"]

log = logging.getLogger(__name__)

SHARDS = "shards/"
ATTEMPT_METADATA = "ckptstore-attempt"
"""User metadata of every shard version: ``step-<020d>.<attempt>``, the attempt that wrote it.
GC reads it to find, without a listing, the one manifest that could pin the version."""
_LIST_FROM_SHARDS = 4
"""From this many shards on, one listing of versions replaces a HEAD per shard."""


def _same_etag(info: ObjectInfo, etag: str) -> bool:
    return (info.etag or "").strip('"') == etag.strip('"')


def _an_area_name(key: str) -> bool:
    """Whether ``key`` is a name the blob area gives (a lease, a generation, a marker)."""
    if key.startswith(LIVE):
        return parse_attempt_name(key[len(LIVE) :], ".") is not None
    return parse_blob_key(key) is not None


def _hidden_keys(versions: Iterable[ObjectInfo], prefix: str) -> frozenset[str]:
    """The keys under ``prefix`` whose current version is a delete marker over versions."""
    hidden, stored = set(), set()
    for version in versions:
        if not version.key.startswith(prefix):
            continue
        if version.is_latest and version.is_delete_marker:
            hidden.add(version.key)
        elif not version.is_delete_marker:
            stored.add(version.key)
    return frozenset(hidden & stored)


def versioned_name(key: str, version_id: str | None) -> str:
    """How a listing of versions names one: ``key@version``."""
    return f"{key}@{version_id}"


def _current_manifests(versions: Iterable[ObjectInfo]) -> set[tuple[int, int]]:
    """The (step, epoch) whose manifest a version listing shows as current (a second
    listing API)."""
    found = set()
    for version in versions:
        name = version.key[len(MANIFESTS) :] if version.key.startswith(MANIFESTS) else ""
        if version.is_latest and not version.is_delete_marker and name.endswith(".json"):
            entry = parse_checkpoint_token(name[: -len(".json")])
            if entry is not None:
                found.add(entry)
    return found


class VersionPinCommit(ConditionalPutCommit):
    """The versioned-object protocol: stable keys, manifests pin versions, GC by version id."""

    name = "version-pin"
    required_capabilities = frozenset({Capability.CONDITIONAL_CREATE, Capability.VERSIONING})

    def _blob_remover(self) -> Callable[[str, str | None], None] | None:
        return self._remove_every_version

    def _lease_hidden(self) -> Callable[[str], bool] | None:
        return self._has_versions

    def _has_versions(self, key: str) -> bool:
        """Whether any version or delete marker of ``key`` is stored (a lease that reads as
        absent is then hidden by a marker: deleted behind ckptstore's back)."""
        return any(v.key == key for v in self.driver.list_versions(key))

    def _remove_every_version(self, key: str, etag: str | None) -> None:
        """Delete every version of ``key`` (a plain DELETE only adds a delete marker): the
        older ones first and the current one last, so that no older version of a lease is
        ever current again while it is removed. ``etag`` (a lease's removal): only while the
        current version is the one GC's claim wrote; a lease created anew since (after
        another GC removed the old one) is left alone, its versions all kept."""
        versions = [v for v in self.driver.list_versions(key) if v.key == key]
        if etag is not None:
            current = [v for v in versions if v.is_latest]
            if not current or current[0].is_delete_marker or not _same_etag(current[0], etag):
                log.info("%s: %s changed since GC claimed it: left alone", self.url, key)
                return
        for version in sorted(versions, key=lambda v: v.is_latest):
            try:
                self.driver.delete(key, version_id=version.version_id)
            except ObjectNotFoundError:
                continue

    def open_root(self, *, create: bool) -> None:
        self.driver.check_bucket()
        status = self.driver.bucket_versioning()
        if status != "Enabled":
            state = "suspended" if status == "Suspended" else "not enabled"
            raise CapabilityError(
                f"{self.url}: versioning is {state} on the bucket; a versioned store pins "
                f"object versions and needs it. Enable it (aws s3api put-bucket-versioning "
                f"--bucket BUCKET --versioning-configuration Status=Enabled), or use s3:// "
                f"for an unversioned bucket",
                url=self.url,
            )

    def open_shard(
        self, step: int, attempt: str, name: str, size_hint: int | None = None
    ) -> ShardSink:
        return ObjectShardSink(
            self.driver,
            f"{SHARDS}{name}",
            self.part_size,
            size_hint,
            self.parts_executor(),
            self.concurrency,
            metadata={ATTEMPT_METADATA: f"{step_token(step)}.{attempt}"},
        )

    def _check_sealed(self, manifest: Manifest) -> None:
        unpinned = [r.name for r in manifest.shards if not r.locator.get("version_id")]
        if unpinned:
            raise CapabilityError(
                f"{self.url}: the storage returned no version id for {unpinned[:3]}; is "
                f"versioning enabled? Nothing was published",
                url=self.url,
            )
        super()._check_sealed(manifest)

    def abort(self, step: int, attempt: str) -> None:
        # The versions an attempt wrote are not known here (keys are shared by all steps):
        # no manifest pins them, so GC deletes them once they are older than the grace period.
        return None

    def _locator_problem(self, manifest: Manifest, record: ShardRecord) -> str | None:
        if "blob" in record.locator:  # shared (§12.3): its generation's version, pinned
            problem = _blob_locator_problem(record)
            if problem is None and not record.locator.get("version_id"):
                return "an unpinned locator"
            return problem
        if record.locator.get("key") != f"{SHARDS}{record.name}":
            return "a foreign locator"
        if not record.locator.get("version_id"):
            # it would read whatever was written to the key last: another step's data
            return "an unpinned locator"
        return None

    def shard_problems(self, manifest: Manifest) -> list[ShardProblem]:
        problems = self._pinned_problems(manifest)
        if problems:
            self._check_still_published(manifest)
        return problems

    def _pinned_problems(self, manifest: Manifest) -> list[ShardProblem]:
        records = manifest.shards
        if len(records) < _LIST_FROM_SHARDS:
            return [problem for r in records if (problem := self._stored_problem(r))]
        # One listing of versions instead of a HEAD per shard; what it does not show as
        # expected is asked of the version itself (a listing may lag behind a write).
        prefix = os.path.commonprefix([r.locator["key"] for r in records])  # noqa: RUF071 (keys)
        listed = {
            (v.key, v.version_id): v.size
            for v in self.driver.list_versions(prefix)
            if not v.is_delete_marker
        }
        problems = []
        for record in records:
            if listed.get((record.locator["key"], record.locator["version_id"])) != record.size:
                problem = self._stored_problem(record)
                if problem is not None:
                    problems.append(problem)
        return problems

    def unpublish(self, step: int, epoch: int = 0) -> None:
        key = self.manifest_key(step, epoch)
        try:
            pinned = [  # a shared blob's version is the leases' to free (§12.3), not this
                (r.locator["key"], r.locator["version_id"])
                for r in self.read_manifest(step, epoch).shards
                if "blob" not in r.locator
            ]
        except IntegrityError:
            pinned = []  # unreadable: its versions are unpinned once it is gone; GC takes them
        self.driver.delete(key)  # a delete marker: the checkpoint is invisible, atomically
        versions = [v for v in self.driver.list_versions(key) if v.key == key]
        # Older versions before the markers: an interruption in between must leave a marker
        # on top, never uncover a manifest version (the checkpoint would be published again).
        for version in sorted(versions, key=lambda v: v.is_delete_marker):
            self.driver.delete(key, version_id=version.version_id)
        for shard_key, version_id in pinned:
            try:
                self.driver.delete(shard_key, version_id=version_id)
            except ObjectNotFoundError:
                continue

    def _pinned(self, entries: Iterable[tuple[int, int]]) -> set[tuple[str, str]] | None:
        """Every (key, version) the manifests of ``entries`` (step, epoch) pin; None if one is
        unreadable."""
        pinned: set[tuple[str, str]] = set()
        for step, epoch in entries:
            try:
                manifest = self.read_manifest(step, epoch)
            except CheckpointNotFoundError:
                continue
            except IntegrityError:
                return None
            pinned.update((r.locator["key"], r.locator["version_id"]) for r in manifest.shards)
        return pinned

    def collect_garbage(self, *, grace_s: float, now: float, dry_run: bool) -> GcReport:
        """Remove versions no manifest pins that are older than ``grace_s`` by the storage's
        clock, and stale uploads; never a version a published manifest pins.

        Ages are measured on the storage's clock, as in ``ConditionalPutCommit``. The pins
        come from every manifest either listing shows (ListObjectsV2 and the version
        listing); then each shard version about to be removed is confirmed unpinned by the
        one manifest that could pin it, read directly: that of the attempt that wrote it
        (named in the version's metadata). A current manifest version is never removed, nor
        a current delete marker while a version it hides remains (an unpublished checkpoint
        would be published again): its versions go first, the marker in a later check. A
        listing that lags or ends early can leave garbage, never remove published data (for
        versions written before their attempt was recorded with them, the listings decide,
        unless they contradict the LATEST hint: then every shard version is kept).
        """
        report = GcReport(dry_run=dry_run, grace_s=grace_s)
        storage_now = self._storage_now(now, report)
        hint = self._hint_before_listing()
        versions = list(self.driver.list_versions(""))
        entries = set(self.published_checkpoints()) | _current_manifests(versions)
        pinned = self._pinned(sorted(entries))
        if pinned is None:
            log.warning("%s: a manifest is unreadable; GC keeps every shard version", self.url)
        elif not self._check_listing(hint, entries, report):
            pinned = None  # versions written without their attempt would be judged by it
        manifests: dict[int, list[Manifest]] = {}
        markers: list[tuple[ObjectInfo, GcItem]] = []
        hidden = _hidden_keys(versions, BLOBS)
        for version in versions:
            kind = self._garbage_kind(version, pinned, hidden)
            if kind is None:
                continue
            item = GcItem(
                kind,
                versioned_name(version.key, version.version_id),
                max(0.0, storage_now - version.last_modified),
                version.size,
            )
            if item.age_s <= grace_s:
                report.kept_young.append(item)
                continue
            if kind == "delete-marker" and not version.key.startswith(SHARDS):
                markers.append((version, item))  # after the versions it may cover
                continue
            if self._still_needed(version, kind, manifests):
                continue
            report.removed.append(item)
            if not dry_run:
                self.driver.delete(version.key, version_id=version.version_id)
        for version, item in markers:
            if self._covers_a_version(version):
                continue  # removing it would publish what it hides; a later GC pass takes it
            report.removed.append(item)
            if not dry_run:
                self.driver.delete(version.key, version_id=version.version_id)
        self._collect_uploads(report, storage_now)
        if any(v.key.startswith(BLOBS) for v in versions):
            self._collect_blob_area(report, storage_now, {}, [])
        return report

    def _covers_a_version(self, marker: ObjectInfo) -> bool:
        """Whether removing ``marker`` could make a version of its key current again (or it
        is gone already): it is current and another version of the key is still stored.

        The key is listed again, on its own: the version listing GC started from may show
        the marker and the versions it hides on different pages, or be stale.
        """
        listed = [v for v in self.driver.list_versions(marker.key) if v.key == marker.key]
        mine = [v for v in listed if v.version_id == marker.version_id]
        if not mine:
            return True  # gone already: nothing to remove
        if not mine[0].is_latest:
            return False  # a newer version is current: removing this one changes nothing
        return any(not v.is_delete_marker for v in listed)

    def _garbage_kind(
        self,
        version: ObjectInfo,
        pinned: set[tuple[str, str]] | None,
        hidden: frozenset[str] = frozenset(),
    ) -> str | None:
        """What an unneeded version is ("shard-version", ...), or None if it is needed."""
        current = version.is_latest and not version.is_delete_marker
        if version.key == LATEST_KEY or version.key.startswith(MANIFESTS):
            # A current delete marker unpublished its key: the versions below it pin nothing
            # (no manifest read shows them) and are "old-version"; the marker itself is
            # removed only once nothing is left below it (``_covers_a_version``).
            if version.is_delete_marker:
                return "delete-marker"
            return None if current else "old-version"
        if version.key.startswith(PROBE_PREFIX):
            return "probe"
        if version.key.startswith(BLOBS):
            # The blob area's current objects are the leases' to judge (§12.3). Older
            # versions of a lease or a liveness marker (each CAS or touch writes a new one)
            # are never read; a generation's older versions go with the generation (the
            # leases' GC deletes every version of it). Only names the area gives are
            # judged, and not a key hidden by a delete marker over its versions (a DELETE
            # ckptstore did not make: its versions are the evidence, kept).
            if not _an_area_name(version.key) or version.key in hidden:
                return None
            if version.is_latest:
                return "delete-marker" if version.is_delete_marker else None
            if version.is_delete_marker:
                return "delete-marker"
            parsed = parse_blob_key(version.key)
            if parsed is not None and parsed[1] is not None:
                # A generation's older version (an upload tried again after an unknown
                # outcome): a save that shared it before the retry pins it, perhaps in a
                # manifest published since the pins were read. It goes with its generation.
                return None
            return "old-version"
        if version.key.startswith(SHARDS):
            if pinned is None or (version.key, version.version_id or "") in pinned:
                return None
            return "delete-marker" if version.is_delete_marker else "shard-version"
        return None

    def _still_needed(
        self, version: ObjectInfo, kind: str, manifests: dict[int, list[Manifest]]
    ) -> bool:
        """Ask storage directly whether a version the listings call garbage is needed after all.

        A shard version is needed if the manifest of the attempt that wrote it pins it (or is
        unreadable); an "old" manifest version if it is in fact the current one.
        """
        if kind == "old-version" and version.key.startswith(MANIFESTS):
            try:
                current = self.driver.head(version.key)
            except ObjectNotFoundError:
                return False
            return current.version_id == version.version_id
        if kind != "shard-version":
            return False
        try:
            info = self.driver.head(version.key, version_id=version.version_id)
        except ObjectNotFoundError:
            return True  # gone already: nothing to remove
        parsed = parse_attempt_name((info.metadata or {}).get(ATTEMPT_METADATA, ""), ".")
        if parsed is None:
            return False  # not written by an attempt that recorded itself: the listings decide
        step = parsed[0]
        if step not in manifests:
            found = []
            for epoch in self.epoch_numbers():  # the attempt's epoch is not recorded with it
                try:
                    found.append(self.read_manifest(step, epoch))
                except CheckpointNotFoundError:
                    continue
                except IntegrityError:
                    log.warning(
                        "%s: step %d's manifest is unreadable; its versions stay", self.url, step
                    )
                    return True
            manifests[step] = found
        needed = any(
            (r.locator["key"], r.locator["version_id"]) == (version.key, version.version_id)
            for manifest in manifests[step]
            for r in manifest.shards
        )
        if needed:
            log.warning(
                "%s: %s is pinned by step %d, whose manifest no listing showed; it stays",
                self.url,
                versioned_name(version.key, version.version_id),
                step,
            )
        return needed

    def _collect_uploads(self, report: GcReport, now: float) -> None:
        for upload in self.incomplete_uploads(SHARDS, report):
            progress = self._upload_progress(upload)
            activity = max(upload.initiated, progress.last_activity)
            item = GcItem(
                "upload",
                f"{upload.key} (upload {upload.upload_id})",
                max(0.0, now - activity),
                progress.size,
            )
            if item.age_s <= report.grace_s:
                report.kept_young.append(item)
                continue
            report.removed.append(item)
            if not report.dry_run:
                self._abort_quietly(upload.key, upload.upload_id)

    def is_empty(self) -> bool:
        return next(iter(self.driver.list_versions("")), None) is None and self._no_uploads()
