"""gs:// and gs+versioned:// against a real fake-gcs-server on 127.0.0.1 (``fake_gcs``).

What fake-gcs-server (1.54) does not do as GCS does, and so what is marked here as needing
real GCS: preconditions on compose (a conditional multipart completion), and deleting one
noncurrent generation by number (it archives the live object instead; docs/backends/gcs.md).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import test_driver_contract as contract
from conftest import extended_conformance

import ckptstore
from ckptstore.backends.gcs import UPLOADS, GCSDriver
from ckptstore.backends.wire_format import crc32c_b64
from ckptstore.conformance.report import render_text
from ckptstore.conformance.runner import run_backend
from ckptstore.driver import ObjectStoreDriver, PutMode
from ckptstore.errors import (
    CapabilityError,
    InvalidOptionError,
    InvalidURLError,
    ObjectNotFoundError,
    StoreNotFoundError,
    TransientStorageError,
)
from ckptstore.tools.embedded_gcs import EmbeddedGCS

KiB, MiB = 1024, 1024 * 1024


def test_embedded_fake_gcs_serves_its_bucket(fake_gcs: EmbeddedGCS) -> None:
    client = fake_gcs.client()
    blob = client.bucket(fake_gcs.bucket).blob("embedded-smoke")
    blob.upload_from_string(b"x", if_generation_match=0)
    assert client.bucket(fake_gcs.bucket).blob("embedded-smoke").download_as_bytes() == b"x"
    versioned = fake_gcs.versioned_bucket("smoke-versioned")
    assert versioned.client().get_bucket("smoke-versioned").versioning_enabled
    assert fake_gcs.environment()["STORAGE_EMULATOR_HOST"] == fake_gcs.endpoint_url


def _driver(server: EmbeddedGCS, scheme: str = "gs", **query: object) -> GCSDriver:
    prefix = f"contract-{os.getpid()}-{secrets.token_hex(4)}"
    store = ckptstore.open(server.url(prefix, scheme=scheme, **query), **server.options)
    driver = store.strategy.driver  # type: ignore[attr-defined]
    assert isinstance(driver, GCSDriver)
    return driver


def _raw(server: EmbeddedGCS, prefix: str, versions: bool = False) -> list[str]:
    client = server.client()
    listed = client.list_blobs(server.bucket, prefix=prefix, versions="true" if versions else None)
    return sorted(blob.name for blob in listed)


class TestGCSDriverContract(contract.TestObjectStoreContract):
    """The object-store contract (tests/test_driver_contract.py) on GCSDriver; where GCS's
    answers are not S3's, the test is restated with GCS's (and why)."""

    @pytest.fixture(params=["fake_gcs"])
    def objects(self, request: pytest.FixtureRequest) -> Iterator[ObjectStoreDriver]:
        driver = _driver(request.getfixturevalue(request.param), min_part_size=5 * MiB)
        yield driver
        for upload in driver.list_multipart_uploads(""):
            driver.abort_multipart(upload.key, upload.upload_id)
        for info in list(driver.list("")):
            driver.delete(info.key)

    @pytest.fixture(params=["fake_gcs"])
    def versions(self, request: pytest.FixtureRequest) -> ObjectStoreDriver:
        server: EmbeddedGCS = request.getfixturevalue(request.param)
        return _driver(server.versioned_bucket("contract-versions"), scheme="gs+versioned")

    def test_multipart_is_invisible_until_complete(self, objects: ObjectStoreDriver) -> None:
        """As S3's, but a composite object's ETag is its generation (no ``-<parts>`` suffix),
        and its pieces are hidden objects, which ``list`` never shows."""
        size = 70 * KiB
        upload = objects.create_multipart("big", metadata={"ckptstore-attempt": "x2"})
        first = objects.upload_part("big", upload, 1, b"a" * size)
        second = objects.upload_part("big", upload, 2, b"b" * 3)
        assert list(objects.list("")) == []
        with pytest.raises(ObjectNotFoundError):
            objects.head("big")
        assert [u.upload_id for u in objects.list_multipart_uploads("")] == [upload]
        progress = objects.upload_progress(next(iter(objects.list_multipart_uploads(""))))
        assert progress.parts == 2 and progress.size == size + 3
        info = objects.complete_multipart("big", upload, [first, second])
        assert info.etag.strip('"').isdigit() and info.size == size + 3
        assert objects.get("big")[0] == b"a" * size + b"b" * 3
        assert dict(objects.head("big").metadata or {}) == {"ckptstore-attempt": "x2"}
        assert list(objects.list_multipart_uploads("")) == []

    def test_multipart_refuses_small_parts_and_aborts(
        self, objects: ObjectStoreDriver, request: pytest.FixtureRequest
    ) -> None:
        """GCS composes parts of any size (no 5 MiB minimum); an abort frees every piece and
        a part sent after it is refused as gone."""
        upload = objects.create_multipart("big")
        objects.upload_part("big", upload, 1, b"a" * 5)
        objects.abort_multipart("big", upload)
        assert list(objects.list_multipart_uploads("")) == []
        with pytest.raises(ObjectNotFoundError):
            objects.upload_part("big", upload, 2, b"c")
        with pytest.raises(ObjectNotFoundError):
            objects.head("big")

    @pytest.mark.skip(reason="needs real GCS: fake-gcs-server ignores ifGenerationMatch on compose")
    def test_multipart_completion_can_create_only(self, objects: ObjectStoreDriver) -> None:
        raise AssertionError("skipped")

    def test_versions_and_delete_markers(self, versions: ObjectStoreDriver) -> None:
        """As S3's up to deleting one old generation, which fake-gcs-server cannot do (the
        driver measures that and leaves the generation alone rather than archive the live
        object)."""
        assert isinstance(versions, GCSDriver)
        if versions.exact_generation_deletes():
            super().test_versions_and_delete_markers(versions)
            return
        assert versions.bucket_versioning() == "Enabled"
        one = versions.put("k", b"one")
        two = versions.put("k", b"two")
        assert one.version_id and two.version_id and one.version_id != two.version_id
        assert versions.get("k", version_id=one.version_id)[0] == b"one"
        versions.delete("k")  # the live generation becomes noncurrent: a delete marker
        with pytest.raises(ObjectNotFoundError):
            versions.get("k")
        assert versions.get("k", version_id=two.version_id)[0] == b"two"
        listed = list(versions.list_versions("k"))
        assert sorted(v.is_delete_marker for v in listed) == [False, False, True]
        assert [v.is_delete_marker for v in listed if v.is_latest] == [True]
        versions.delete("k", version_id=one.version_id)  # left alone: still readable
        assert versions.get("k", version_id=one.version_id)[0] == b"one"


def test_list_start_after_skips_the_equal_key(fake_gcs: EmbeddedGCS) -> None:
    """GCS's ``startOffset`` is inclusive; ``start_after`` is not."""
    driver = _driver(fake_gcs)
    for key in ("a", "b", "c"):
        driver.put(key, b"x")
    assert [i.key for i in driver.list("", start_after="b")] == ["c"]
    assert [i.key for i in driver.list("", start_after="bb")] == ["c"]


def test_more_parts_than_one_compose_takes(fake_gcs: EmbeddedGCS) -> None:
    """70 parts: composed in a tree (32 sources per call), every intermediate removed."""
    driver = _driver(fake_gcs)
    upload = driver.create_multipart("tree")
    parts = [driver.upload_part("tree", upload, n, bytes([n]) * 1000) for n in range(1, 71)]
    info = driver.complete_multipart("tree", upload, parts)
    assert info.size == 70_000
    assert driver.get("tree")[0] == b"".join(bytes([n]) * 1000 for n in range(1, 71))
    assert _raw(fake_gcs, driver.prefix + UPLOADS) == []


def test_leftovers_of_a_completed_upload_are_found_and_removed(fake_gcs: EmbeddedGCS) -> None:
    """A crash between the compose and the cleanup leaves pieces of an upload that did
    complete: the next listing of uploads removes them instead of reporting them."""
    driver = _driver(fake_gcs)
    upload = driver.create_multipart("done")
    part = driver.upload_part("done", upload, 1, b"x" * 100)
    driver._remove_pieces = lambda key, upload_id: 0  # type: ignore[method-assign]
    driver.complete_multipart("done", upload, [part])
    del driver._remove_pieces
    assert _raw(fake_gcs, driver.prefix + UPLOADS) != []
    assert list(driver.list_multipart_uploads("")) == []
    assert _raw(fake_gcs, driver.prefix + UPLOADS) == []
    assert driver.get("done")[0] == b"x" * 100


def test_pieces_without_their_marker_are_still_an_upload(fake_gcs: EmbeddedGCS) -> None:
    """An abort interrupted after deleting the ``init`` marker (it goes last, but a stray
    part can land after it): the remaining piece is found, and removed by an abort."""
    driver = _driver(fake_gcs)
    upload = driver.create_multipart("orphan")
    driver.upload_part("orphan", upload, 1, b"x")
    driver.client.bucket(fake_gcs.bucket).blob(
        f"{driver.prefix}{UPLOADS}orphan/{upload}.init"
    ).delete()
    (found,) = driver.list_multipart_uploads("")
    assert (found.key, found.upload_id) == ("orphan", upload)
    assert driver.upload_progress(found).parts == 1
    driver.abort_multipart(found.key, found.upload_id)
    assert _raw(fake_gcs, driver.prefix) == []


def test_crc32c_goes_with_every_upload(fake_gcs: EmbeddedGCS, monkeypatch: Any) -> None:
    """Each upload (a put, a part) carries its CRC32C in the object resource, which GCS
    checks against the body (fake-gcs-server computes its own and checks nothing, so the
    refusal of a mismatch needs real GCS; here: that it is sent)."""
    driver = _driver(fake_gcs)
    session = driver.client._http
    sent: list[bytes] = []
    real = session.request

    def recording(method: str, url: str, data: Any = None, **kwargs: Any) -> Any:
        if method == "POST" and "uploadType=multipart" in url:
            sent.append(bytes(data))
        return real(method, url, data=data, **kwargs)

    monkeypatch.setattr(session, "request", recording)
    driver.put("whole", b"payload")
    upload = driver.create_multipart("parts")
    driver.upload_part("parts", upload, 1, b"part one")
    monkeypatch.undo()
    driver.abort_multipart("parts", upload)
    assert len(sent) == 3  # the put, the upload's marker, the part
    assert f'"crc32c": "{crc32c_b64(b"payload")}"'.encode() in sent[0]
    assert f'"crc32c": "{crc32c_b64(b"part one")}"'.encode() in sent[2]


def test_versioned_overwrite_keeps_the_pinned_generation(fake_gcs: EmbeddedGCS) -> None:
    """A composite upload over a live object of a versioned bucket keeps the old generation
    readable by its number (fake-gcs-server would renumber it: the driver archives first)."""
    driver = _driver(fake_gcs.versioned_bucket("pinned-gens"), scheme="gs+versioned")
    old = driver.put("shards/a", b"old")
    upload = driver.create_multipart("shards/a")
    part = driver.upload_part("shards/a", upload, 1, b"new")
    new = driver.complete_multipart("shards/a", upload, [part])
    assert old.version_id != new.version_id
    assert driver.get("shards/a", version_id=old.version_id)[0] == b"old"
    assert driver.get("shards/a", version_id=new.version_id)[0] == b"new"
    assert driver.get("shards/a")[0] == b"new"


def test_conditional_writes(fake_gcs: EmbeddedGCS) -> None:
    driver = _driver(fake_gcs)
    first = driver.put("m", b"1", mode=PutMode.CREATE)
    with pytest.raises(ckptstore.errors.PreconditionFailedError):
        driver.put("m", b"2", mode=PutMode.CREATE)
    with pytest.raises(ckptstore.errors.PreconditionFailedError):
        driver.put("m", b"2", mode=PutMode.update('"12345"'))
    with pytest.raises(ckptstore.errors.PreconditionFailedError):
        driver.put("m", b"2", mode=PutMode.update("not-a-generation"))
    assert driver.put("m", b"3", mode=PutMode.update(first.etag)).etag != first.etag


# -- a writer killed mid-upload ---------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, time, ckptstore
    store = ckptstore.open(sys.argv[1])
    with store.begin(2) as pending, pending.open_shard("model/rank0.bin") as shard:
        for index in range(100000):
            shard.write(bytes([index % 251]) * (64 * 1024))
            time.sleep(0.01)
    """
)


def test_sigkill_mid_upload_then_gc_removes_the_pieces(fake_gcs: EmbeddedGCS) -> None:
    prefix = f"killed-{os.getpid()}"
    url = fake_gcs.url(prefix, part_size=256 * KiB, concurrency=2)
    store = ckptstore.open(url, **fake_gcs.options)
    store.save(1, {"model/rank0.bin": b"previous" * 1000})
    driver = store.strategy.driver  # type: ignore[attr-defined]
    environment = {**os.environ, **fake_gcs.environment()}
    with subprocess.Popen([sys.executable, "-c", WRITER, url], env=environment) as writer:
        deadline = time.monotonic() + 60
        while True:  # until the upload has parts on the server, while the writer still writes
            uploads = list(driver.list_multipart_uploads(""))
            if uploads and driver.upload_progress(uploads[0]).parts >= 2:
                break
            assert writer.poll() is None, "the writer ended before its upload was under way"
            assert time.monotonic() < deadline, "no composite upload under way after 60 s"
            time.sleep(0.05)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert store.latest().step == 1
    assert store.latest().read("model/rank0.bin") == b"previous" * 1000
    (upload,) = driver.list_multipart_uploads("")
    assert upload.key.startswith("step-00000000000000000002.")
    assert _raw(fake_gcs, f"{prefix}/{UPLOADS}")  # pieces are stored, hidden from listings
    assert all(not info.key.startswith(UPLOADS) for info in driver.list(""))
    assert store.gc().removed == []  # younger than the grace period: it may be alive
    later = ckptstore.open(url, clock=lambda: time.time() + 7200, **fake_gcs.options)
    report = later.gc(grace=timedelta(hours=1))
    assert [item.kind for item in report.removed] == ["attempt"]
    assert report.removed[0].size > 0  # the pieces' bytes counted as freed
    assert _raw(fake_gcs, f"{prefix}/{UPLOADS}") == []
    assert [k for k in _raw(fake_gcs, f"{prefix}/") if "step-00000000000000000002." in k] == []
    assert store.latest().read("model/rank0.bin") == b"previous" * 1000


# -- conformance ----------------------------------------------------------------------------


@pytest.mark.slow  # every crash point, over HTTP
@pytest.mark.parametrize("scheme", ["gs", pytest.param("gs+versioned", marks=extended_conformance)])
def test_conformance_holds_on_fake_gcs_server(fake_gcs: EmbeddedGCS, scheme: str) -> None:
    server = fake_gcs.versioned_bucket("conformance-v") if scheme == "gs+versioned" else fake_gcs
    url = server.url(f"conformance-{os.getpid()}", scheme=scheme, part_size=4096, concurrency=1)
    report = run_backend(url, options=server.options, profile="ci")
    text = render_text([report])
    print(text)  # the capability probe table of fake-gcs-server, in the test log
    assert not report.storage_errors, text
    assert report.ok, text
    assert all(r.status == "held" for r in report.invariants.values()), text
    declared = {p.capability for p in report.capabilities if p.declared}
    assert {"conditional-create", "compare-and-swap", "multipart"} <= declared
    measured = {p.capability: p.measured for p in report.capabilities}
    # fake-gcs-server ignores ifGenerationMatch on compose: measured missing, not needed
    assert measured["conditional-multipart-complete"] == "violated"
    if scheme == "gs+versioned":  # it cannot delete one generation: measured missing
        assert measured["version-delete"] == "violated"


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("gs://Bad_Bucket/x", InvalidURLError, "not a valid GCS bucket"),
        ("gs://ab/x", InvalidURLError, "not a valid GCS bucket"),
        ("gs://goog-bucket/x", InvalidURLError, "not a valid GCS bucket"),
        ("gs://ok-bucket/.ckptstore-uploads/x", InvalidURLError, "ckptstore's own"),
        ("gs://ok-bucket/x?colour=blue", InvalidOptionError, "unknown option"),
        ("gs://ok-bucket/x?token=secret", InvalidOptionError, "token must be"),
        ("gs://ok-bucket/x?endpoint_url=127.0.0.1:1", InvalidOptionError, "http"),
        ("gs://ok-bucket/x?credentials_file=/nonexistent.json", InvalidOptionError, "credentials"),
    ],
)
def test_bad_gcs_urls(url: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ckptstore.open(url)


def test_malformed_service_account_file(tmp_path: Any) -> None:
    path = tmp_path / "sa.json"
    path.write_text('{"type": "service_account"}')
    with pytest.raises(InvalidOptionError, match="credentials_file"):
        ckptstore.open(f"gs://ok-bucket/x?credentials_file={path}")


def test_missing_bucket_is_a_clear_error(fake_gcs: EmbeddedGCS) -> None:
    url = fake_gcs.url("x").replace(f"gs://{fake_gcs.bucket}/", "gs://no-such-bucket-here/")
    with pytest.raises(StoreNotFoundError, match=r"no-such-bucket-here.*does not exist"):
        ckptstore.open(url, **fake_gcs.options)


def test_unreachable_endpoint_fails_within_seconds() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TransientStorageError, match="cannot reach"):
        ckptstore.open(f"gs://bucket/run?endpoint_url=http://127.0.0.1:{port}")
    assert time.monotonic() - started < 10


def test_unversioned_bucket_is_refused_for_gs_versioned(fake_gcs: EmbeddedGCS) -> None:
    plain = fake_gcs.plain_bucket("plain-for-versioned")
    with pytest.raises(CapabilityError, match=r"versioning is not enabled.*gs://"):
        ckptstore.open(plain.url("x", scheme="gs+versioned"), **plain.options)


def test_registry_names_the_gcs_extra() -> None:
    from ckptstore.registry import _BUILTIN

    assert _BUILTIN["gs"][1] == _BUILTIN["gs+versioned"][1] == "pip install 'ckptstore[gcs]'"
