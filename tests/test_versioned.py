"""The versioned-object backend: manifests pin object versions of stable keys."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from conftest import extended_conformance

import ckptstore
from ckptstore import CapabilityError, KeepLast
from ckptstore.backends.memory import drop_bucket, get_bucket
from ckptstore.conformance.report import render_text
from ckptstore.conformance.runner import run_backend
from ckptstore.errors import ManifestCorruptError, ShardMissingError
from ckptstore.manifest import MAX_MANIFEST_BYTES, _document_checksum
from ckptstore.tools.embedded import EmbeddedS3

_ids = itertools.count()


@dataclass
class VersionedTarget:
    """A versioned store location, and raw access to every version under it."""

    url: str
    options: dict[str, Any]
    server: EmbeddedS3 | None
    bucket: str
    prefix: str

    def open(self, **extra: Any) -> ckptstore.Store:
        return ckptstore.open(self.url, **{**self.options, **extra})

    def versions(self) -> list[tuple[str, str, bool, bool]]:
        """(key, version id, is latest, is delete marker) of everything under the prefix."""
        if self.server is None:
            bucket = get_bucket(self.bucket)
            return [
                (key[len(self.prefix) :], v.version_id, i == len(vs) - 1, v.is_delete_marker)
                for key, vs in bucket.objects.items()
                if key.startswith(self.prefix)
                for i, v in enumerate(vs)
            ]
        listed = self.server.client().list_object_versions(Bucket=self.bucket, Prefix=self.prefix)
        rows = [
            (v["Key"][len(self.prefix) :], v["VersionId"], v["IsLatest"], False)
            for v in listed.get("Versions", [])
        ]
        rows += [
            (v["Key"][len(self.prefix) :], v["VersionId"], v["IsLatest"], True)
            for v in listed.get("DeleteMarkers", [])
        ]
        return rows

    def overwrite(self, key: str, data: bytes) -> None:
        """A foreign writer puts a new version of a stable key."""
        if self.server is None:
            from ckptstore.backends.memory import MemoryDriver

            MemoryDriver(get_bucket(self.bucket), self.prefix).put(key, data)
        else:
            self.server.client().put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def delete_version(self, key: str, version_id: str) -> None:
        if self.server is None:
            from ckptstore.backends.memory import MemoryDriver

            MemoryDriver(get_bucket(self.bucket), self.prefix).delete(key, version_id=version_id)
        else:
            self.server.client().delete_object(
                Bucket=self.bucket, Key=self.prefix + key, VersionId=version_id
            )


@pytest.fixture(params=["memory", "moto"])
def target(request: pytest.FixtureRequest) -> Iterator[VersionedTarget]:
    prefix = f"run-{os.getpid()}-{next(_ids)}/"
    if request.param == "memory":
        bucket = f"versioned-{os.getpid()}-{next(_ids)}"
        url = f"memory+versioned://{bucket}/{prefix}?min_part_size=1024&part_size=1024"
        yield VersionedTarget(url, {}, None, bucket, prefix)
        drop_bucket(bucket)
        return
    server: EmbeddedS3 = request.getfixturevalue("moto_s3").versioned_bucket("versioned")
    url = server.url(prefix, scheme="s3+versioned", part_size=4096)
    yield VersionedTarget(url, server.options, server, server.bucket, prefix)


def test_shards_live_at_stable_keys_pinned_by_version(target: VersionedTarget) -> None:
    store = target.open()
    store.save(1, {"model/rank0.bin": b"one" * 2000, "trainer.json": b"{}"})
    store.save(2, {"model/rank0.bin": b"two" * 2000, "trainer.json": b"{}"})
    first, second = store.get(1), store.get(2)
    assert first.shards["model/rank0.bin"].locator["key"] == "shards/model/rank0.bin"
    assert second.shards["model/rank0.bin"].locator["key"] == "shards/model/rank0.bin"
    assert (
        first.shards["model/rank0.bin"].locator["version_id"]
        != second.shards["model/rank0.bin"].locator["version_id"]
    )
    assert first.read("model/rank0.bin") == b"one" * 2000
    assert second.read("model/rank0.bin") == b"two" * 2000


def test_overwriting_stable_keys_never_changes_a_published_checkpoint(
    target: VersionedTarget,
) -> None:
    store = target.open()
    store.save(1, {"w.bin": b"A" * 5000, "t.json": b"1"})
    before = {name: store.get(1).read(name) for name in ("w.bin", "t.json")}
    target.overwrite("shards/w.bin", b"foreign writer")  # someone writes the key directly
    store.save(2, {"w.bin": b"B" * 7000, "t.json": b"2"})  # and the next step rewrites it
    target.overwrite("shards/t.json", b"garbage")
    after = {name: store.get(1).read(name) for name in ("w.bin", "t.json")}
    assert after == before
    assert store.get(1).verify().ok
    assert store.get(2).read("w.bin") == b"B" * 7000


def test_retention_and_gc_leave_only_pinned_versions(target: VersionedTarget) -> None:
    now = [time.time()]
    store = target.open(retention=KeepLast(2), clock=lambda: now[0])
    for step in range(1, 6):
        store.save(step, {"w.bin": bytes([step]) * 3000, "opt.bin": bytes([step]) * 5000})
    target.overwrite("shards/w.bin", b"foreign")  # an unpinned version
    dead = store.begin(6)  # an attempt whose writer died
    dead.write("w.bin", b"dead" * 100)
    young = store.begin(7)  # and one still writing
    now[0] += 7200
    young.write("w.bin", b"young" * 100)  # written "now", after the clock moved
    report = store.gc(grace=timedelta(hours=1))
    assert report.removed
    retained = [store.get(step) for step in store.steps()]
    assert [c.step for c in retained] == [4, 5]
    pinned = {
        (r.locator["key"], r.locator["version_id"]) for c in retained for r in c.shards.values()
    }
    for key, version, latest, marker in target.versions():
        if key == "LATEST" or key.startswith("manifests/"):
            assert latest and not marker, (key, version)  # only the current ones
            continue
        young_version = key == "shards/w.bin" and latest
        assert (key, version) in pinned or young_version, (key, version, marker)
    assert {c.step: c.read("w.bin") for c in retained} == {4: b"\x04" * 3000, 5: b"\x05" * 3000}


@pytest.mark.parametrize("others", [0, 5])  # few shards: a HEAD each; more: one listing
def test_deleted_pinned_version_is_reported_and_skipped(
    target: VersionedTarget, others: int
) -> None:
    store = target.open()
    extra = {f"layer/{i}.bin": bytes([i]) * 10 for i in range(others)}
    store.save(1, {"w.bin": b"1" * 100, **extra})
    store.save(2, {"w.bin": b"2" * 100, **extra})
    assert store.get(2).verify().ok
    record = store.get(2).shards["w.bin"]
    target.delete_version(record.locator["key"], record.locator["version_id"])
    with pytest.raises(ShardMissingError, match=r"'w\.bin' is missing"):
        store.get(2)
    fallback = store.latest(verified=True)
    assert fallback is not None
    assert fallback.step == 1
    assert fallback.read("w.bin") == b"1" * 100  # never the other version of the key


@pytest.mark.parametrize(
    ("locator", "problem"),
    [
        ({"key": "shards/w.bin"}, "an unpinned locator"),  # reads whatever is there last
        ({"key": "shards/other.bin", "version_id": "x"}, "a foreign locator"),
    ],
)
def test_a_manifest_that_does_not_pin_its_own_key_is_refused(
    target: VersionedTarget, locator: dict[str, str], problem: str
) -> None:
    store = target.open()
    store.save(1, {"w.bin": b"1" * 100})
    document = json.loads(store.get(1).manifest.encode())
    document["shards"][0]["locator"] = locator
    document["checksum"] = _document_checksum(document)  # re-signed, as an attacker would
    target.overwrite("manifests/step-00000000000000000001.json", json.dumps(document).encode())
    with pytest.raises(ManifestCorruptError, match=f"'w.bin' has {problem}"):
        store.get(1)


def test_a_manifest_is_read_bounded_in_memory() -> None:
    """A planted manifest object larger than any manifest is refused after reading one byte
    more than the limit, not read whole into memory."""
    bucket = f"versioned-{os.getpid()}-{next(_ids)}"
    store = ckptstore.open(f"memory+versioned://{bucket}/run")
    try:
        store.save(1, {"w.bin": b"1"})
        versions = get_bucket(bucket).objects["run/manifests/step-00000000000000000001.json"]
        huge = bytearray(MAX_MANIFEST_BYTES + 1024)
        versions[-1].data = huge
        asked: list[int] = []
        opened = store.strategy.driver.open_read

        def recording_open_read(key: str, **kw: Any) -> Any:
            stream = opened(key, **kw)
            read = stream.read
            stream.read = lambda n=-1: (asked.append(n), read(n))[1]
            return stream

        store.strategy.driver.open_read = recording_open_read
        with pytest.raises(ManifestCorruptError, match="step-00000000000000000001"):
            store.get(1)
        assert asked == [MAX_MANIFEST_BYTES + 1]
    finally:
        store.close()
        drop_bucket(bucket)


def test_unversioned_bucket_is_refused_with_a_clear_message(moto_s3: EmbeddedS3) -> None:
    url = moto_s3.url("plain", scheme="s3+versioned")
    with pytest.raises(CapabilityError, match=r"versioning is not enabled.*put-bucket-versioning"):
        ckptstore.open(url, **moto_s3.options)


@pytest.mark.slow  # minutes: every crash point, over HTTP
@pytest.mark.parametrize(
    "server_name", ["moto_s3", pytest.param("seaweedfs_s3", marks=extended_conformance)]
)
def test_conformance_holds_on_versioned_buckets(
    server_name: str, request: pytest.FixtureRequest
) -> None:
    server: EmbeddedS3 = request.getfixturevalue(server_name).versioned_bucket("conformance-v")
    part = max(server.min_part_size, 4096)
    url = server.url(f"v-{os.getpid()}", scheme="s3+versioned", part_size=part, concurrency=1)
    report = run_backend(url, options=server.options, profile="ci")
    text = render_text([report])
    print(text)
    assert not report.storage_errors, (  # CI's own server failing is not a violation
        f"storage error, not an invariant violation: the embedded server kept failing after "
        f"retries ({'; '.join(report.storage_errors)})\n{text}"
    )
    assert report.ok, text
    assert all(r.status == "held" for r in report.invariants.values()), text
