"""One contract per driver family, run against every driver of the family.

The object-store contract runs on the memory driver and on ``S3Driver`` against each embedded
S3 server, so the memory driver's claim to S3's semantics is proven, not asserted. The file
system contract runs on the POSIX driver, the Lustre driver and the conformance suite's
simulated file system. Where real servers legitimately differ (the protocol copes with both),
the contract names the answers it accepts.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import fsspec_s3_options, fsspec_s3_url

import ckptstore
from ckptstore.backends.lustre import LustreDriver
from ckptstore.backends.memory import MemoryBucket, MemoryDriver
from ckptstore.backends.posix import PosixDriver
from ckptstore.conformance.models.simfs import SimulatedFileSystem
from ckptstore.driver import (
    Capability,
    DriverFamily,
    FileSystemDriver,
    ObjectStoreDriver,
    PutMode,
    driver_family,
)
from ckptstore.errors import (
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TargetExistsError,
)
from ckptstore.tools.embedded import EmbeddedS3

# -- object stores ---------------------------------------------------------------------------

OBJECT_STORES = ["memory", "moto_s3", "seaweedfs_s3", "fsspec_s3"]
QUIRKS: dict[str, dict[str, str]] = {}
"""Where an embedded server departs from AWS, as measured here, and what that costs."""


def _s3_driver(server: EmbeddedS3, scheme: str = "s3") -> Any:
    prefix = f"contract-{os.getpid()}-{secrets.token_hex(4)}"
    return ckptstore.open(server.url(prefix, scheme=scheme), **server.options).strategy.driver


@pytest.fixture(params=OBJECT_STORES)
def objects(request: pytest.FixtureRequest) -> Iterator[ObjectStoreDriver]:
    """A fresh, empty prefix on each object store."""
    if request.param == "memory":
        yield MemoryDriver(MemoryBucket("contract", min_part_size=5 * 1024 * 1024), "pre/fix")
        return
    if request.param == "fsspec_s3":
        server: EmbeddedS3 = request.getfixturevalue("moto_s3")
        url = fsspec_s3_url(server, f"contract-{os.getpid()}-{secrets.token_hex(4)}")
        driver = ckptstore.open(url, **fsspec_s3_options(server)).strategy.driver
    else:
        driver = _s3_driver(request.getfixturevalue(request.param))
    yield driver
    for upload in driver.list_multipart_uploads(""):
        driver.abort_multipart(upload.key, upload.upload_id)
    for info in list(driver.list("")):
        driver.delete(info.key)


@pytest.fixture(params=[store for store in OBJECT_STORES if store != "fsspec_s3"])
def versions(request: pytest.FixtureRequest) -> ObjectStoreDriver:
    """A fresh prefix in a bucket with versioning enabled, on each object store."""
    if request.param == "memory":
        return MemoryDriver(MemoryBucket("v", versioned=True, min_part_size=10), "p")
    server: EmbeddedS3 = request.getfixturevalue(request.param)
    return _s3_driver(server.versioned_bucket("contract-versions"), scheme="s3+versioned")


class TestObjectStoreContract:
    def test_family(self, objects: ObjectStoreDriver) -> None:
        assert driver_family(objects) is DriverFamily.OBJECT_STORE

    def test_put_get_head_delete(self, objects: ObjectStoreDriver) -> None:
        info = objects.put("a/b", b"hello", metadata={"ckptstore-attempt": "x1"})
        assert info.etag.startswith('"') and info.size == 5
        data, got = objects.get("a/b")
        assert data == b"hello" and got.etag == info.etag
        head = objects.head("a/b")
        assert head.size == 5 and head.etag == info.etag
        assert dict(head.metadata or {}) == {"ckptstore-attempt": "x1"}
        with objects.open_read("a/b") as stream:
            assert stream.read() == b"hello"
        objects.delete("a/b")
        for call in (objects.get, objects.head, objects.open_read):
            with pytest.raises(ObjectNotFoundError):
                call("a/b")
        objects.delete("a/b")  # deleting what is gone is not an error

    def test_create_only_once(self, objects: ObjectStoreDriver) -> None:
        objects.put("k", b"1", mode=PutMode.CREATE)
        with pytest.raises(PreconditionFailedError):
            objects.put("k", b"2", mode=PutMode.CREATE)
        assert objects.get("k")[0] == b"1"

    def test_update_is_compare_and_swap(self, objects: ObjectStoreDriver) -> None:
        if Capability.COMPARE_AND_SWAP not in objects.capabilities:
            pytest.skip("fsspec has no compare-and-swap: the driver does not declare it")
        first = objects.put("k", b"1")
        second = objects.put("k", b"2", mode=PutMode.update(first.etag))
        with pytest.raises(PreconditionFailedError):
            objects.put("k", b"3", mode=PutMode.update(first.etag))
        objects.put("k", b"4", mode=PutMode.update(second.etag.strip('"')))  # unquoted too
        assert objects.get("k")[0] == b"4"
        # AWS answers 404, some servers 412: either way, nothing is written (probes.py)
        with pytest.raises((ObjectNotFoundError, PreconditionFailedError)):
            objects.put("absent", b"x", mode=PutMode.update(first.etag))
        with pytest.raises(ObjectNotFoundError):
            objects.head("absent")

    def test_list_is_sorted_and_resumable(self, objects: ObjectStoreDriver) -> None:
        for key in ("m/3", "m/1", "m/2", "n/1"):
            objects.put(key, b"x")
        assert [i.key for i in objects.list("m/")] == ["m/1", "m/2", "m/3"]
        assert [i.key for i in objects.list("m/", start_after="m/1")] == ["m/2", "m/3"]
        objects.delete("m/2")
        assert [i.key for i in objects.list("")] == ["m/1", "m/3", "n/1"]
        assert [i.size for i in objects.list("n/")] == [1]

    def test_multipart_is_invisible_until_complete(self, objects: ObjectStoreDriver) -> None:
        size = objects.min_part_size
        upload = objects.create_multipart("big", metadata={"ckptstore-attempt": "x2"})
        first = objects.upload_part("big", upload, 1, b"a" * size)
        second = objects.upload_part("big", upload, 2, b"b" * 3)
        assert list(objects.list("")) == []
        with pytest.raises(ObjectNotFoundError):
            objects.head("big")
        assert [u.upload_id for u in objects.list_multipart_uploads("")] == [upload]
        progress = objects.upload_progress(objects.list_multipart_uploads("").__next__())
        assert progress.parts == 2 and progress.size == size + 3
        assert progress.last_activity <= time.time() + 60
        info = objects.complete_multipart("big", upload, [first, second])
        assert info.etag.endswith('-2"') and info.size == size + 3
        assert objects.get("big")[0] == b"a" * size + b"b" * 3
        assert dict(objects.head("big").metadata or {}) == {"ckptstore-attempt": "x2"}
        assert list(objects.list_multipart_uploads("")) == []

    def test_multipart_refuses_small_parts_and_aborts(
        self, objects: ObjectStoreDriver, request: pytest.FixtureRequest
    ) -> None:
        upload = objects.create_multipart("big")
        first = objects.upload_part("big", upload, 1, b"a" * 5)
        second = objects.upload_part("big", upload, 2, b"b" * 5)
        with pytest.raises(StorageError):
            objects.complete_multipart("big", upload, [first, second])  # a small first part
        objects.abort_multipart("big", upload)
        assert list(objects.list_multipart_uploads("")) == []
        quirk = QUIRKS.get(request.node.callspec.params["objects"], {})
        aborted = StorageError if "part-after-abort" in quirk else ObjectNotFoundError
        with pytest.raises(aborted):
            objects.upload_part("big", upload, 3, b"c")
        with pytest.raises(ObjectNotFoundError):
            objects.head("big")

    def test_multipart_completion_can_create_only(self, objects: ObjectStoreDriver) -> None:
        objects.put("k", b"exists")
        upload = objects.create_multipart("k")
        part = objects.upload_part("k", upload, 1, b"new")
        with pytest.raises(PreconditionFailedError):
            objects.complete_multipart("k", upload, [part], mode=PutMode.CREATE)
        assert objects.get("k")[0] == b"exists"
        with pytest.raises(InvalidInputError, match="never updates"):
            objects.complete_multipart("k", upload, [part], mode=PutMode.update('"e"'))
        objects.abort_multipart("k", upload)

    def test_versions_and_delete_markers(self, versions: ObjectStoreDriver) -> None:
        assert versions.bucket_versioning() == "Enabled"
        one = versions.put("k", b"one")
        two = versions.put("k", b"two")
        assert one.version_id and two.version_id and one.version_id != two.version_id
        assert versions.get("k", version_id=one.version_id)[0] == b"one"
        versions.delete("k")  # a delete marker, not a deletion
        with pytest.raises(ObjectNotFoundError):
            versions.get("k")
        assert versions.get("k", version_id=two.version_id)[0] == b"two"
        listed = list(versions.list_versions("k"))
        assert sorted(v.is_delete_marker for v in listed) == [False, False, True]
        assert [v.is_delete_marker for v in listed if v.is_latest] == [True]
        versions.delete("k", version_id=one.version_id)
        with pytest.raises(ObjectNotFoundError):
            versions.get("k", version_id=one.version_id)
        assert len(list(versions.list_versions("k"))) == 2


# -- file systems ----------------------------------------------------------------------------

FILE_SYSTEMS = ["posix", "lustre", "simulated"]


@pytest.fixture(params=FILE_SYSTEMS)
def files(request: pytest.FixtureRequest, tmp_path: Any) -> FileSystemDriver:
    """A fresh, empty root on each file-system driver."""
    driver: FileSystemDriver
    if request.param == "posix":
        driver = PosixDriver(str(tmp_path / "root"))
    elif request.param == "lustre":
        driver = LustreDriver(str(tmp_path / "root"), None)
    else:
        driver = SimulatedFileSystem(time.time)
    driver.ensure_root(create=True)
    return driver


def _write(files: FileSystemDriver, path: str, data: bytes) -> None:
    handle = files.create(path)
    try:
        files.write(handle, data)
        files.start_writeback(handle)
        files.fsync(handle)
    finally:
        files.close(handle)


class TestFileSystemContract:
    def test_family(self, files: FileSystemDriver) -> None:
        assert driver_family(files) is DriverFamily.FILE_SYSTEM

    def test_create_write_read_stat(self, files: FileSystemDriver) -> None:
        files.mkdir("d")
        _write(files, "d/f", b"hello")
        files.fsync_dir("d")
        with files.open_read("d/f") as stream:
            assert stream.read() == b"hello"
        assert files.stat("d/f").size == 5 and not files.stat("d/f").is_dir
        assert files.stat("d").is_dir
        with pytest.raises(StorageError):
            files.create("d/f")  # exclusive
        with pytest.raises(StorageError):
            files.mkdir("d")  # exists

    def test_listdir_is_sorted(self, files: FileSystemDriver) -> None:
        for name in ("c", "a", "b"):
            _write(files, name, b"")
        files.mkdir("z")
        assert files.listdir("") == ["a", "b", "c", "z"]

    def test_rename_noreplace_never_replaces(self, files: FileSystemDriver) -> None:
        files.mkdir("staging")
        _write(files, "staging/m", b"1")
        files.mkdir("published")
        _write(files, "published/m", b"0")
        with pytest.raises(TargetExistsError):
            files.rename_noreplace("staging", "published")
        with files.open_read("published/m") as stream:
            assert stream.read() == b"0"
        files.rename_noreplace("staging", "step")
        assert files.listdir("") == ["published", "step"]

    def test_rename_replace_and_removal(self, files: FileSystemDriver) -> None:
        _write(files, "hint.tmp", b"2")
        _write(files, "hint", b"1")
        files.rename_replace("hint.tmp", "hint")
        with files.open_read("hint") as stream:
            assert stream.read() == b"2"
        files.mkdir("d")
        files.unlink("hint")
        files.rmdir("d")
        assert files.listdir("") == []

    def test_missing_paths_are_not_found(self, files: FileSystemDriver) -> None:
        for call in (files.stat, files.open_read, files.unlink, files.rmdir, files.listdir):
            with pytest.raises(ObjectNotFoundError):
                call("missing")
        with pytest.raises(ObjectNotFoundError):
            files.rename_noreplace("missing", "other")
