"""A large shard on S3 is read as ranged GETs in parallel, straight into the caller's buffer,
and still returns only the committed bytes of one object: each block checked as its range
lands, the shard's CRC32C combined from the blocks', every range pinned by If-Match to the
object one HEAD found. On moto; nothing here is timed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import urllib3
from conftest import S3Backend

import ckptstore
import ckptstore.checkpoint
import ckptstore.checksum
from ckptstore.backends.s3 import S3Driver
from ckptstore.errors import (
    InvalidOptionError,
    PreconditionFailedError,
    ShardCorruptError,
    ShardMissingError,
    StorageError,
)
from ckptstore.store import Store
from ckptstore.tools.embedded import EmbeddedS3

BLOCK = 1024
RANGE = 3 * BLOCK  # three blocks a GET


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckptstore.checksum, "BLOCK_SIZE", BLOCK)
    monkeypatch.setattr(ckptstore.checkpoint, "_PIPELINE_PIECE", BLOCK)  # ranged from 2 KiB


def _data(size: int) -> bytes:
    """Bytes without 0xFF (what a replacing object is made of), different in every block."""
    return bytes((i * 7 + i // BLOCK) % 251 for i in range(size))


@pytest.fixture
def location(tmp_path: Any, moto_s3: EmbeddedS3) -> S3Backend:
    return S3Backend(tmp_path, moto_s3)


def _open(location: S3Backend, concurrency: int = 4) -> Store:
    return location.open(read_concurrency=concurrency, read_range_size=RANGE)


class _RangeLog:
    """Records each ranged read the driver is asked for; ``after`` runs after the n-th."""

    def __init__(self, driver: S3Driver, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int]] = []
        self.after: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        read_range = driver.read_range

        def logged(key: str, offset: int, into: Any, **kwargs: Any) -> Any:
            info = read_range(key, offset, into, **kwargs)
            with self._lock:
                self.calls.append((offset, memoryview(into).nbytes))
                hook = self.after.get(len(self.calls))
            if hook is not None:
                hook()
            return info

        monkeypatch.setattr(driver, "read_range", logged)


@pytest.mark.parametrize(
    "size",
    [2 * BLOCK, 2 * BLOCK + 1, 3 * BLOCK, 3 * BLOCK - 1, 10 * BLOCK + 17, 12 * BLOCK],
)
def test_bytes_are_exact_whatever_the_size(
    location: S3Backend, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    store = _open(location)
    data = _data(size)
    store.save(1, {"w": data})
    log = _RangeLog(store.strategy.driver, monkeypatch)
    buffer = bytearray(size)
    assert store.get(1).read_into("w", buffer) == size
    assert bytes(buffer) == data
    ranges = sorted(log.calls)
    assert ranges == [(start, min(RANGE, size - start)) for start in range(0, size, RANGE)]


def test_read_into_a_numpy_array_and_a_memoryview(location: S3Backend) -> None:
    store = _open(location)
    values = np.arange(5000, dtype=np.float32)  # 20000 bytes: not whole blocks
    store.save(1, {"w": values})
    into = np.zeros_like(values)
    assert store.get(1).read_into("w", into) == values.nbytes
    assert np.array_equal(into, values)
    view = memoryview(bytearray(values.nbytes))
    store.get(1).read_into("w", view)
    assert bytes(view) == values.tobytes()
    with pytest.raises(ValueError, match="buffer has"):
        store.get(1).read_into("w", bytearray(values.nbytes + 1))


def test_zero_length_and_small_shards(location: S3Backend) -> None:
    store = _open(location)
    store.save(1, {"empty": b"", "small": b"abc"})
    checkpoint = store.get(1)
    assert checkpoint.read_into("empty", bytearray(0)) == 0
    assert checkpoint.read("empty") == b""
    buffer = bytearray(3)
    assert checkpoint.read_into("small", buffer) == 3 and buffer == b"abc"


def test_a_damaged_block_is_named(location: S3Backend) -> None:
    store = _open(location)
    data = _data(10 * BLOCK + 5)
    store.save(1, {"w": data})
    position = 7 * BLOCK + 3

    def flip(stored: bytes) -> bytes:
        changed = bytearray(stored)
        changed[position] ^= 0x01
        return bytes(changed)

    location.rewrite_shard(store, 1, "w", flip)
    with pytest.raises(ShardCorruptError, match=r"'w'.*CRC32C mismatch in block 7 \(bytes 7168"):
        store.get(1).read_into("w", bytearray(len(data)))


@pytest.mark.parametrize(
    "edit",
    [lambda data: data[:-1], lambda data: data + b"\0"],
    ids=["truncated", "extended"],
)
def test_a_shard_of_another_size_is_refused_before_reading(
    location: S3Backend, monkeypatch: pytest.MonkeyPatch, edit: Callable[[bytes], bytes]
) -> None:
    store = _open(location)
    data = _data(6 * BLOCK)
    store.save(1, {"w": data})
    location.rewrite_shard(store, 1, "w", edit)
    log = _RangeLog(store.strategy.driver, monkeypatch)
    with pytest.raises(ShardCorruptError, match=r"'w'.*manifest says 6144"):
        store.get(1).read_into("w", bytearray(len(data)))
    assert log.calls == []


def test_an_object_replaced_mid_read_is_detected_not_mixed(
    location: S3Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(location, concurrency=1)  # one range at a time: replaced after the first
    data = _data(9 * BLOCK)
    store.save(1, {"w": data})
    log = _RangeLog(store.strategy.driver, monkeypatch)
    log.after[1] = lambda: location.rewrite_shard(store, 1, "w", lambda old: b"\xff" * len(old))
    buffer = bytearray(len(data))
    with pytest.raises(ShardCorruptError, match=r"'w'.*replaced while being read"):
        store.get(1).read_into("w", buffer)
    assert 0xFF not in buffer  # not one byte of the new object
    assert buffer[:RANGE] == data[:RANGE]


def test_an_object_deleted_mid_read_is_a_missing_shard(
    location: S3Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(location, concurrency=1)
    store.save(1, {"w": _data(9 * BLOCK)})
    log = _RangeLog(store.strategy.driver, monkeypatch)
    log.after[1] = lambda: location.remove_shard(store, 1, "w")
    with pytest.raises(ShardMissingError, match="disappeared while being read"):
        store.get(1).read_into("w", bytearray(9 * BLOCK))


class _BreakingBody:
    """A GetObject body whose connection breaks once ``after`` bytes have been read."""

    def __init__(self, inner: Any, after: int) -> None:
        self._inner, self._left = inner, after

    def readinto(self, view: memoryview) -> int:
        if self._left <= 0:
            raise urllib3.exceptions.ProtocolError("Connection reset by peer")
        count = int(self._inner.readinto(view[: self._left]))
        self._left -= count
        return count

    def close(self) -> None:
        self._inner.close()


class _FlakyClient:
    """A boto3 client whose ranged GETs fail as scripted, once each: ``503`` (the request
    refused) or a number (the body breaks after that many bytes)."""

    def __init__(self, inner: Any, faults: dict[str, int | str]) -> None:
        self.inner, self.faults = inner, dict(faults)
        self.ranges: list[str] = []

    def get_object(self, **args: Any) -> Any:
        wanted = str(args.get("Range", ""))
        self.ranges.append(wanted)
        fault = self.faults.pop(wanted, None)
        if fault == "503":
            from botocore.exceptions import ClientError

            raise ClientError(
                {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}},
                "GetObject",
            )
        response = self.inner.get_object(**args)
        if isinstance(fault, int):
            response["Body"] = _BreakingBody(response["Body"], fault)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_transient_error_on_one_range_is_retried(location: S3Backend) -> None:
    store = _open(location)
    data = _data(9 * BLOCK)
    store.save(1, {"w": data})
    driver = store.strategy.driver
    assert isinstance(driver, S3Driver)
    flaky = _FlakyClient(driver.client, {"bytes=3072-6143": 1000, "bytes=6144-9215": "503"})
    driver.client = flaky
    try:
        buffer = bytearray(len(data))
        store.get(1).read_into("w", buffer)
    finally:
        driver.client = flaky.inner
    assert bytes(buffer) == data
    assert flaky.faults == {}  # both faults happened
    assert flaky.ranges.count("bytes=4072-6143") == 1  # resumed from the byte reached
    assert flaky.ranges.count("bytes=6144-9215") == 2  # refused, then asked again


class _UnquotedIfMatchClient:
    """A boto3 client for a server that refuses quoted ETags in If-Match on GET (412)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.refused = 0

    def get_object(self, **args: Any) -> Any:
        etag = args.get("IfMatch")
        if etag is not None and etag.startswith('"'):
            self.refused += 1
            from botocore.exceptions import ClientError

            raise ClientError(
                {
                    "Error": {"Code": "PreconditionFailed"},
                    "ResponseMetadata": {"HTTPStatusCode": 412},
                },
                "GetObject",
            )
        if etag is not None:
            args["IfMatch"] = f'"{etag}"'  # what moto itself wants
        return self.inner.get_object(**args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_server_wanting_unquoted_etags_in_if_match_is_read_all_the_same(
    location: S3Backend,
) -> None:
    store = _open(location)
    data = _data(9 * BLOCK)
    store.save(1, {"w": data})
    driver = store.strategy.driver
    assert isinstance(driver, S3Driver)
    client = _UnquotedIfMatchClient(driver.client)
    driver.client = client
    try:
        buffer = bytearray(len(data))
        store.get(1).read_into("w", buffer)
        assert bytes(buffer) == data
        refused = client.refused
        assert 1 <= refused <= 4  # once per range already under way, then remembered
        store.get(1).read_into("w", buffer)
        assert client.refused == refused
    finally:
        driver.client = client.inner


def test_the_driver_reads_a_range_of_one_version_only(location: S3Backend) -> None:
    store = _open(location)
    data = _data(5000)
    store.save(1, {"w": data})
    driver = store.strategy.driver
    assert isinstance(driver, S3Driver)
    key = store.get(1).shards["w"].locator["key"]
    info = driver.head(key)
    into = bytearray(1000)
    got = driver.read_range(key, 4000, into, if_match=info.etag)
    assert bytes(into) == data[4000:] and got.size == 5000 and got.etag == info.etag
    assert driver.read_range(key, 5000, bytearray(0), if_match=info.etag).size == 5000
    with pytest.raises(StorageError, match="answered"):
        driver.read_range(key, 4500, bytearray(1000))  # past the end
    with pytest.raises(PreconditionFailedError):
        driver.read_range(key, 0, bytearray(10), if_match='"0123456789abcdef"')
    with pytest.raises(ValueError, match="writable"):
        driver.read_range(key, 0, b"0123456789")


def test_read_options_are_checked(location: S3Backend) -> None:
    with pytest.raises(InvalidOptionError, match="read_concurrency"):
        location.open(read_concurrency=0)
    store = location.open(read_range_size=5 * BLOCK)
    assert store.strategy.settings()["read_range_size"] == 5 * BLOCK


class _Requests:
    """The GetObject (with their Range) and HeadObject requests the S3 client sends."""

    def __init__(self, driver: S3Driver) -> None:
        self.gets: list[str | None] = []
        self.heads = 0
        events = driver.client.meta.events
        events.register("before-call.s3.GetObject", self._get)
        events.register("before-call.s3.HeadObject", self._head)

    def _get(self, params: dict[str, Any], **_: Any) -> None:
        self.gets.append(params.get("headers", {}).get("Range"))

    def _head(self, **_: Any) -> None:
        self.heads += 1


@pytest.mark.parametrize(
    ("offset", "length", "expected"),
    [
        (0, 100, ["bytes=0-1023"]),  # in the first block: that block only
        (1500, 100, ["bytes=1024-2047"]),  # inside one block
        (1000, 100, ["bytes=0-1023", "bytes=1024-2047"]),  # across two: each its own buffer
        (BLOCK, 3 * BLOCK, ["bytes=1024-4095"]),  # whole blocks: one GET, in place
        (BLOCK, 5 * BLOCK, ["bytes=1024-4095", "bytes=4096-6143"]),  # a RANGE at most a GET
        (  # partial head and tail blocks around whole ones
            BLOCK - 1,
            4 * BLOCK + 2,
            ["bytes=0-1023", "bytes=1024-4095", "bytes=4096-5119", "bytes=5120-6143"],
        ),
        (10 * BLOCK + 7, 10, ["bytes=10240-10256"]),  # in the short last block
    ],
)
def test_a_range_asks_only_for_the_blocks_it_touches_bounded_never_a_whole_get(
    location: S3Backend, offset: int, length: int, expected: list[str]
) -> None:
    store = _open(location)
    data = _data(10 * BLOCK + 17)
    store.save(1, {"w": data})
    checkpoint = store.get(1)
    requests = _Requests(store.strategy.driver)
    assert bytes(checkpoint.read_range("w", offset, length)) == data[offset : offset + length]
    assert sorted(requests.gets) == sorted(expected)  # type: ignore[arg-type]
    assert requests.heads == 1  # the pin
    into = bytearray(length + 3)
    checkpoint.read_range("w", offset, length, into)
    assert bytes(into[:length]) == data[offset : offset + length]
    assert requests.heads == 1  # one pin per shard and checkpoint object


def test_a_damaged_block_in_a_range_is_named_and_wiped(location: S3Backend) -> None:
    store = _open(location)
    data = _data(10 * BLOCK + 5)
    store.save(1, {"w": data})

    def flip(stored: bytes) -> bytes:
        changed = bytearray(stored)
        changed[3 * BLOCK + 3] ^= 0x01
        return bytes(changed)

    location.rewrite_shard(store, 1, "w", flip)
    checkpoint = store.get(1)
    into = bytearray(b"\xff" * (4 * BLOCK))
    with pytest.raises(ShardCorruptError, match=r"'w'.*CRC32C mismatch in block 3 \(bytes 3072"):
        checkpoint.read_range("w", BLOCK, 4 * BLOCK, into)
    assert bytes(into[2 * BLOCK : 3 * BLOCK]) == bytes(BLOCK)  # the failing range zeroed
    assert bytes(checkpoint.read_range("w", 0, 2 * BLOCK)) == data[: 2 * BLOCK]


def test_a_range_of_an_object_replaced_after_the_pin_is_refused(location: S3Backend) -> None:
    store = _open(location)
    data = _data(6 * BLOCK)
    store.save(1, {"w": data})
    checkpoint = store.get(1)
    assert bytes(checkpoint.read_range("w", 0, BLOCK)) == data[:BLOCK]  # pinned
    location.rewrite_shard(store, 1, "w", lambda stored: b"\xff" * len(stored))
    with pytest.raises(ShardCorruptError, match="replaced while being read"):
        checkpoint.read_range("w", 2 * BLOCK, BLOCK)
