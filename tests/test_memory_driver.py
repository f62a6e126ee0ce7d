"""The memory driver is the oracle: it must have exactly S3's semantics."""

from __future__ import annotations

import pytest

from ckptstore.backends.memory import MemoryBucket, MemoryDriver
from ckptstore.driver import PutMode
from ckptstore.errors import (
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
)


@pytest.fixture
def driver() -> MemoryDriver:
    return MemoryDriver(MemoryBucket("t", min_part_size=10), "pre/fix")


@pytest.fixture
def versioned() -> MemoryDriver:
    return MemoryDriver(MemoryBucket("v", versioned=True, min_part_size=10), "p")


def test_put_get_head_and_prefix(driver):
    info = driver.put("a/b", b"hello")
    assert info.etag.startswith('"') and info.version_id is None
    data, got = driver.get("a/b")
    assert data == b"hello" and got.etag == info.etag
    assert driver.head("a/b").size == 5
    assert list(driver.bucket.objects) == ["pre/fix/a/b"]
    with pytest.raises(ObjectNotFoundError):
        driver.get("missing")


def test_if_none_match_creates_only_once(driver):
    driver.put("k", b"1", mode=PutMode.CREATE)
    with pytest.raises(PreconditionFailedError):
        driver.put("k", b"2", mode=PutMode.CREATE)
    assert driver.get("k")[0] == b"1"


def test_if_match_is_compare_and_swap(driver):
    first = driver.put("k", b"1")
    second = driver.put("k", b"2", mode=PutMode.update(first.etag))
    with pytest.raises(PreconditionFailedError):
        driver.put("k", b"3", mode=PutMode.update(first.etag))
    unquoted = second.etag.strip('"')  # unquoted etags are accepted
    driver.put("k", b"4", mode=PutMode.update(unquoted))
    assert driver.get("k")[0] == b"4"
    with pytest.raises(ObjectNotFoundError):
        driver.put("absent", b"x", mode=PutMode.update(first.etag))


def test_list_is_sorted_with_start_after(driver):
    for key in ("m/3", "m/1", "m/2", "n/1"):
        driver.put(key, b"x")
    assert [i.key for i in driver.list("m/")] == ["m/1", "m/2", "m/3"]
    assert [i.key for i in driver.list("m/", start_after="m/1")] == ["m/2", "m/3"]
    driver.delete("m/2")
    assert [i.key for i in driver.list("")] == ["m/1", "m/3", "n/1"]


def test_multipart_is_invisible_until_complete(driver):
    upload = driver.create_multipart("big")
    p1 = driver.upload_part("big", upload, 1, b"a" * 10)
    p2 = driver.upload_part("big", upload, 2, b"b" * 3)
    assert list(driver.list("")) == []
    assert [u.upload_id for u in driver.list_multipart_uploads("")] == [upload]
    info = driver.complete_multipart("big", upload, [p1, p2])
    assert info.etag.endswith('-2"')
    assert driver.get("big")[0] == b"a" * 10 + b"b" * 3
    assert list(driver.list_multipart_uploads("")) == []


def test_multipart_rejects_small_parts_and_bad_lists(driver):
    upload = driver.create_multipart("big")
    p1 = driver.upload_part("big", upload, 1, b"a" * 5)
    p2 = driver.upload_part("big", upload, 2, b"b" * 5)
    with pytest.raises(StorageError, match="too small"):
        driver.complete_multipart("big", upload, [p1, p2])
    with pytest.raises(StorageError, match="ascending"):
        driver.complete_multipart("big", upload, [p2, p1])
    driver.abort_multipart("big", upload)
    with pytest.raises(ObjectNotFoundError):
        driver.upload_part("big", upload, 3, b"c")


def test_multipart_complete_honours_if_none_match(driver):
    driver.put("k", b"exists")
    upload = driver.create_multipart("k")
    part = driver.upload_part("k", upload, 1, b"new")
    with pytest.raises(PreconditionFailedError):
        driver.complete_multipart("k", upload, [part], mode=PutMode.CREATE)
    assert driver.get("k")[0] == b"exists"


def test_versions_and_delete_markers(versioned):
    v1 = versioned.put("k", b"one")
    v2 = versioned.put("k", b"two")
    assert v1.version_id and v2.version_id and v1.version_id != v2.version_id
    assert versioned.get("k", version_id=v1.version_id)[0] == b"one"
    versioned.delete("k")  # a delete marker, not a deletion
    with pytest.raises(ObjectNotFoundError):
        versioned.get("k")
    assert versioned.get("k", version_id=v2.version_id)[0] == b"two"
    listed = list(versioned.list_versions(""))
    assert [v.is_delete_marker for v in listed] == [True, False, False]
    assert listed[0].is_latest
    versioned.delete("k", version_id=v1.version_id)
    with pytest.raises(ObjectNotFoundError):
        versioned.get("k", version_id=v1.version_id)
    assert len(list(versioned.list_versions(""))) == 2


def test_a_put_mode_says_one_thing():
    assert PutMode.OVERWRITE.conditional is False
    assert PutMode.CREATE.conditional and PutMode.update('"e"').conditional
    with pytest.raises(InvalidInputError, match="needs the ETag"):
        PutMode("update")
    with pytest.raises(InvalidInputError, match="needs the ETag"):
        PutMode("create", '"e"')  # a create that is also an update: refused
    with pytest.raises(InvalidInputError, match="unknown put mode"):
        PutMode("replace")  # type: ignore[arg-type]


def test_a_multipart_completion_is_never_an_update(driver):
    first = driver.put("k", b"1")
    upload = driver.create_multipart("k")
    part = driver.upload_part("k", upload, 1, b"x")
    with pytest.raises(InvalidInputError, match="never updates"):
        driver.complete_multipart("k", upload, [part], mode=PutMode.update(first.etag))
    assert driver.get("k")[0] == b"1"
