"""What only the memory driver has: keys under its prefix in a process-wide bucket, and the
PutMode value it shares with every object store. Its S3 semantics are proven by the
object-store contract (test_driver_contract.py), which runs on it and on real S3 servers."""

from __future__ import annotations

import pytest

from ckptstore.backends.memory import MemoryBucket, MemoryDriver
from ckptstore.driver import PutMode
from ckptstore.errors import InvalidInputError, ObjectNotFoundError


def test_keys_live_under_the_prefix() -> None:
    driver = MemoryDriver(MemoryBucket("t", min_part_size=10), "pre/fix")
    info = driver.put("a/b", b"hello")
    assert info.version_id is None
    assert list(driver.bucket.objects) == ["pre/fix/a/b"]
    other = MemoryDriver(driver.bucket, "other")
    with pytest.raises(ObjectNotFoundError):
        other.get("a/b")
    assert list(other.list("")) == []


def test_a_put_mode_says_one_thing() -> None:
    assert PutMode.OVERWRITE.conditional is False
    assert PutMode.CREATE.conditional and PutMode.update('"e"').conditional
    with pytest.raises(InvalidInputError, match="needs the ETag"):
        PutMode("update")
    with pytest.raises(InvalidInputError, match="needs the ETag"):
        PutMode("create", '"e"')  # a create that is also an update: refused
    with pytest.raises(InvalidInputError, match="unknown put mode"):
        PutMode("replace")  # type: ignore[arg-type]
