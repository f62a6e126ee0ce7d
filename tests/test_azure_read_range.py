"""The Azure driver's ``read_range`` (``RangedReadDriver``) against Azurite on 127.0.0.1: a range
lands exactly in the caller's buffer, every byte from the one blob ``If-Match`` names; a body
that breaks is asked for again from the byte reached under the same ETag; and a large shard on
an ``az://`` store is read as ranged GetBlobs in parallel through it. Faults in a body are
injected by wrapping the answers the driver reads from; the server is the real Azurite."""

from __future__ import annotations

import errno
import http.client
import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import urllib3
from conftest import AzureBackend

import ckptstore
import ckptstore.checkpoint
import ckptstore.checksum
from ckptstore.backends import azure
from ckptstore.backends.azure import AzureBlobDriver, RangeAnswer
from ckptstore.commit.conditional_put import DEFAULT_READ_RANGE_SIZE
from ckptstore.driver import RangedReadDriver
from ckptstore.errors import (
    InvalidInputError,
    InvalidOptionError,
    ObjectNotFoundError,
    PreconditionFailedError,
    ShardCorruptError,
    ShardMissingError,
    StorageError,
    TransientStorageError,
)
from ckptstore.store import Store
from ckptstore.tools.embedded_azure import EmbeddedAzure

BLOCK = 1024
RANGE = 3 * BLOCK  # three blocks a GetBlob
SENTINEL = 0xEE
"""What a buffer holds before a read: no blob here is made of it."""


def _data(size: int) -> bytes:
    """Bytes without 0xFF (what a replacing blob is made of) or 0xEE, different in every block."""
    return bytes((i * 7 + i // BLOCK) % 229 for i in range(size))


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block checksums of 1 KiB, and ranged reads from 2 KiB shards."""
    monkeypatch.setattr(ckptstore.checksum, "BLOCK_SIZE", BLOCK)
    monkeypatch.setattr(ckptstore.checkpoint, "_PIPELINE_PIECE", BLOCK)


@pytest.fixture
def location(tmp_path: Any, azurite: EmbeddedAzure) -> AzureBackend:
    return AzureBackend(tmp_path, azurite)


def _open(location: AzureBackend, concurrency: int = 4, **options: Any) -> Store:
    return location.open(read_concurrency=concurrency, read_range_size=RANGE, **options)


def _driver(store: Store) -> AzureBlobDriver:
    driver = store.strategy.driver
    assert isinstance(driver, AzureBlobDriver)
    return driver


def _blob(store: Store, data: bytes, key: str = "blob") -> tuple[AzureBlobDriver, str]:
    """``data`` put at ``key``; the driver and the blob's ETag."""
    driver = _driver(store)
    return driver, driver.put(key, data).etag


# -- the driver: exact ranges of one blob --------------------------------------------------


def test_the_azure_driver_reads_ranges(location: AzureBackend) -> None:
    driver = _driver(_open(location))
    assert isinstance(driver, RangedReadDriver)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, 100), (4000, 1000), (9000, 1000), (0, 10_000), (1, 9_998), (9_999, 1)],
    ids=["start", "middle", "end", "whole", "all-but-the-edges", "last-byte"],
)
def test_a_range_fills_the_buffer_exactly(location: AzureBackend, offset: int, length: int) -> None:
    data = _data(10_000)
    driver, etag = _blob(_open(location), data)
    buffer = bytearray([SENTINEL]) * (length + 20)
    info = driver.read_range("blob", offset, memoryview(buffer)[10 : 10 + length], if_match=etag)
    assert bytes(buffer[10 : 10 + length]) == data[offset : offset + length]
    assert buffer[:10] == buffer[-10:] == bytes([SENTINEL]) * 10  # nothing written around it
    assert (info.size, info.etag, info.key) == (10_000, etag, "blob")


def test_a_range_lands_in_a_numpy_array_and_without_if_match(location: AzureBackend) -> None:
    values = np.arange(3000, dtype=np.float32)
    driver, _ = _blob(_open(location), values.tobytes())
    into = np.zeros(1000, dtype=np.float32)
    info = driver.read_range("blob", 4000, into)  # elements 1000..1999, unpinned
    assert np.array_equal(into, values[1000:2000])
    assert info.size == values.nbytes


def test_an_empty_range_asks_the_etag_only(location: AzureBackend) -> None:
    data = _data(5000)
    driver, etag = _blob(_open(location), data)
    info = driver.read_range("blob", 5000, bytearray(0), if_match=etag)
    assert (info.size, info.etag) == (5000, etag)
    assert driver.read_range("blob", 0, bytearray(0)).size == 5000
    with pytest.raises(PreconditionFailedError, match="ETag"):
        driver.read_range("blob", 0, bytearray(0), if_match='"0x8DEADBEEF"')
    with pytest.raises(ObjectNotFoundError):
        driver.read_range("missing", 0, bytearray(0))


def test_a_replaced_blob_is_refused_and_nothing_of_it_lands(location: AzureBackend) -> None:
    data = _data(8000)
    driver, etag = _blob(_open(location), data)
    driver.put("blob", b"\xff" * 8000)  # replaced: a new ETag
    buffer = bytearray([SENTINEL]) * 8000
    with pytest.raises(PreconditionFailedError, match="ConditionNotMet"):
        driver.read_range("blob", 0, buffer, if_match=etag)
    assert buffer == bytes([SENTINEL]) * 8000  # untouched: not one byte of the new blob
    with pytest.raises(PreconditionFailedError):  # the ETag as head gives it, or bare
        driver.read_range("blob", 100, bytearray(10), if_match=etag.strip('"'))


def test_a_deleted_blob_is_not_found(location: AzureBackend) -> None:
    driver, etag = _blob(_open(location), _data(1000))
    driver.delete("blob")
    buffer = bytearray([SENTINEL]) * 500
    with pytest.raises(ObjectNotFoundError, match="BlobNotFound") as raised:
        driver.read_range("blob", 0, buffer, if_match=etag)
    assert raised.value.key == "blob"
    assert buffer == bytes([SENTINEL]) * 500


@pytest.mark.parametrize(
    ("offset", "length"),
    [(4500, 1000), (5000, 10), (9000, 10)],
    ids=["across-the-end", "at-the-end", "beyond-the-end"],
)
def test_a_range_past_the_end_is_a_storage_error(
    location: AzureBackend, offset: int, length: int
) -> None:
    driver, etag = _blob(_open(location), _data(5000))
    buffer = bytearray([SENTINEL]) * length
    with pytest.raises(StorageError, match=r"past the blob's end|InvalidRange") as raised:
        driver.read_range("blob", offset, buffer, if_match=etag)
    assert not isinstance(raised.value, (TransientStorageError, ObjectNotFoundError))


def test_bad_buffers_and_offsets_are_refused(location: AzureBackend) -> None:
    driver, _ = _blob(_open(location), _data(100))
    with pytest.raises(InvalidInputError, match="writable"):
        driver.read_range("blob", 0, b"0123456789")
    with pytest.raises(InvalidInputError, match="negative"):
        driver.read_range("blob", -1, bytearray(10))


# -- a body that breaks --------------------------------------------------------------------

Fault = tuple[str, int]
"""How one answer's body breaks: ``reset``, ``timeout``, ``incomplete`` (the socket's and
http.client's errors) or ``short`` (the body ends early), after that many bytes."""

_ERRORS: dict[str, Callable[[], BaseException]] = {
    "reset": lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "timeout": lambda: TimeoutError("The read operation timed out"),
    "incomplete": lambda: http.client.IncompleteRead(b"", 10),
}


def _breaking(readinto: Callable[[memoryview], int], fault: Fault) -> Callable[[memoryview], int]:
    kind, left = fault

    def read(view: memoryview) -> int:
        nonlocal left
        if left <= 0:
            if kind == "short":
                return 0
            raise _ERRORS[kind]()
        count = readinto(view[:left])
        left -= count
        return count

    return read


class _Answers:
    """Wraps the driver's ``open_range``: records each GetBlob (first, last, If-Match), breaks
    the bodies of the first answers as ``faults`` say, and runs ``before[n]`` before the n-th."""

    def __init__(
        self, driver: AzureBlobDriver, monkeypatch: pytest.MonkeyPatch, faults: list[Fault]
    ) -> None:
        self.requests: list[tuple[int, int, str | None]] = []
        self.before: dict[int, Callable[[], None]] = {}
        self._faults = list(faults)
        self._lock = threading.Lock()
        open_range = driver.open_range

        def answer(
            key: str, first: int, last: int, *, version_id: str | None = None,
            etag: str | None = None,
        ) -> RangeAnswer:  # fmt: skip
            with self._lock:
                self.requests.append((first, last, etag))
                hook = self.before.get(len(self.requests))
                fault = self._faults.pop(0) if self._faults else None
            if hook is not None:
                hook()
            got = open_range(key, first, last, version_id=version_id, etag=etag)
            return got if fault is None else replace(got, readinto=_breaking(got.readinto, fault))

        monkeypatch.setattr(driver, "open_range", answer)


@pytest.mark.parametrize("kind", ["reset", "timeout", "incomplete", "short"])
def test_a_broken_body_is_resumed_from_the_byte_reached(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    data = _data(3 * 1024 * 1024 + 5)  # more than one INTO_PIECE
    driver, etag = _blob(_open(location), data)
    answers = _Answers(driver, monkeypatch, [(kind, 1_500_000), (kind, 700_000)])
    buffer = bytearray(len(data) - 10)
    info = driver.read_range("blob", 10, buffer, if_match=etag)
    assert bytes(buffer) == data[10:]
    assert info.size == len(data) and info.etag == etag
    last = len(data) - 1
    assert answers.requests == [
        (10, last, etag),
        (10 + 1_500_000, last, etag),  # from the byte reached, under the same If-Match
        (10 + 2_200_000, last, etag),
    ]


def test_an_unpinned_read_resumes_pinned_to_the_first_answer(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _data(50_000)
    driver, etag = _blob(_open(location), data)
    answers = _Answers(driver, monkeypatch, [("reset", 20_000)])
    buffer = bytearray(len(data))
    driver.read_range("blob", 0, buffer)  # no If-Match given
    assert bytes(buffer) == data
    assert answers.requests == [(0, 49_999, None), (20_000, 49_999, etag)]


def test_a_blob_replaced_before_a_resume_is_refused_not_spliced(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _data(50_000)
    driver, etag = _blob(_open(location), data)
    answers = _Answers(driver, monkeypatch, [("reset", 20_000)])
    answers.before[2] = lambda: driver.put("blob", b"\xff" * 50_000)
    buffer = bytearray([SENTINEL]) * len(data)
    with pytest.raises(PreconditionFailedError):
        driver.read_range("blob", 0, buffer)  # unpinned: resumes under the first ETag
    assert bytes(buffer[:20_000]) == data[:20_000]
    assert 0xFF not in buffer  # not one byte of the new blob
    assert answers.requests[1] == (20_000, 49_999, etag)


def test_a_blob_deleted_before_a_resume_is_not_found(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, etag = _blob(_open(location), _data(50_000))
    answers = _Answers(driver, monkeypatch, [("short", 30_000)])
    answers.before[2] = lambda: driver.delete("blob")
    with pytest.raises(ObjectNotFoundError):
        driver.read_range("blob", 0, bytearray(50_000), if_match=etag)


def test_a_body_that_keeps_breaking_fails_after_the_drivers_attempts(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, etag = _blob(_open(location, max_attempts=3), _data(50_000))
    answers = _Answers(driver, monkeypatch, [("reset", 1000)] * 10)
    with pytest.raises(TransientStorageError, match="connection broke at byte 3000"):
        driver.read_range("blob", 0, bytearray(50_000), if_match=etag)
    assert [first for first, _, _ in answers.requests] == [0, 1000, 2000]


def test_the_body_layers_are_the_known_ones(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Canary: ``read_range`` reads a body straight from the socket, below azure-core's
    requests transport (urllib3's ``_fp``, ``_fp_bytes_read``: private, behind
    ``azure._body_reader`` only), through the generated GetBlob operation
    (``BlobClient._client``). An SDK, requests or urllib3 that changed them fails here,
    loudly; reads stay correct meanwhile (the next test), only slower."""
    data = _data(20_000)
    driver, etag = _blob(_open(location), data)
    seen: list[bool] = []
    direct = azure.direct_body_reads

    def spy(raw: object) -> bool:
        seen.append(direct(raw))
        return seen[-1]

    monkeypatch.setattr(azure, "direct_body_reads", spy)
    buffer = bytearray(len(data))
    driver.read_range("blob", 0, buffer, if_match=etag)
    assert bytes(buffer) == data
    assert seen == [True], "azure-core/requests/urllib3 changed the layers of an answer's body"


def test_without_the_known_layers_a_body_is_read_from_its_chunks(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _data(3 * 1024 * 1024 + 5)
    driver, etag = _blob(_open(location), data)
    monkeypatch.setattr(azure, "direct_body_reads", lambda raw: False)
    answers = _Answers(driver, monkeypatch, [("reset", 1_234_567)])
    buffer = bytearray(len(data) - 7)
    assert driver.read_range("blob", 7, buffer, if_match=etag).size == len(data)
    assert bytes(buffer) == data[7:]
    assert [first for first, _, _ in answers.requests] == [7, 7 + 1_234_567]


def test_connections_go_back_to_the_pool(location: AzureBackend) -> None:
    """A body read to its end leaves its connection for the next request: many reads, one
    connection (read one after another)."""
    data = _data(100_000)
    driver, etag = _blob(_open(location), data)
    opened: list[object] = []
    real = urllib3.connection.HTTPConnection.connect

    def connect(self: urllib3.connection.HTTPConnection) -> None:
        opened.append(self)
        real(self)

    buffer = bytearray(10_000)
    driver.read_range("blob", 0, buffer, if_match=etag)  # a connection to reuse
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(urllib3.connection.HTTPConnection, "connect", connect)
        for start in range(0, 100_000, 10_000):
            driver.read_range("blob", start, buffer, if_match=etag)
            assert bytes(buffer) == data[start : start + 10_000]
    assert opened == []


# -- a checkpoint on az:// reads large shards through read_range ---------------------------


class _RangeLog:
    """Records each ``read_range`` the driver is asked for; ``after[n]`` runs after the n-th."""

    def __init__(self, driver: AzureBlobDriver, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int]] = []
        self.heads = 0
        self.after: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        read_range, head = driver.read_range, driver.head

        def logged(key: str, offset: int, into: Any, **kwargs: Any) -> Any:
            info = read_range(key, offset, into, **kwargs)
            with self._lock:
                self.calls.append((offset, memoryview(into).nbytes))
                hook = self.after.get(len(self.calls))
            if hook is not None:
                hook()
            return info

        def counted(key: str, **kwargs: Any) -> Any:
            with self._lock:
                self.heads += 1
            return head(key, **kwargs)

        monkeypatch.setattr(driver, "read_range", logged)
        monkeypatch.setattr(driver, "head", counted)


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("size", [2 * BLOCK, 3 * BLOCK - 1, 10 * BLOCK + 17, 12 * BLOCK])
def test_read_into_goes_through_read_range_and_is_exact(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    store = _open(location)
    data = _data(size)
    store.save(1, {"w": data})
    log = _RangeLog(_driver(store), monkeypatch)
    buffer = bytearray(size)
    assert store.get(1).read_into("w", buffer) == size
    assert bytes(buffer) == data
    assert sorted(log.calls) == [(s, min(RANGE, size - s)) for s in range(0, size, RANGE)]
    assert log.heads == 1  # the pin


@pytest.mark.usefixtures("small_blocks")
def test_checkpoint_read_range_goes_through_read_range(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(location)
    data = _data(10 * BLOCK + 17)
    store.save(1, {"w": data})
    checkpoint = store.get(1)
    log = _RangeLog(_driver(store), monkeypatch)
    assert (
        bytes(checkpoint.read_range("w", BLOCK - 1, 4 * BLOCK + 2))
        == data[BLOCK - 1 : 5 * BLOCK + 1]
    )
    assert sorted(log.calls) == [(0, BLOCK), (BLOCK, 3 * BLOCK), (4 * BLOCK, BLOCK),
                                 (5 * BLOCK, BLOCK)]  # fmt: skip
    into = bytearray(100)
    checkpoint.read_range("w", 10 * BLOCK, 17, into)
    assert bytes(into[:17]) == data[10 * BLOCK :]
    assert log.heads == 1  # one pin per shard and checkpoint object


@pytest.mark.usefixtures("small_blocks")
def test_a_shard_replaced_mid_read_is_detected_not_mixed(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(location, concurrency=1)  # one range at a time: replaced after the first
    data = _data(9 * BLOCK)
    store.save(1, {"w": data})
    log = _RangeLog(_driver(store), monkeypatch)
    log.after[1] = lambda: location.rewrite_shard(store, 1, "w", lambda old: b"\xff" * len(old))
    buffer = bytearray(len(data))
    with pytest.raises(ShardCorruptError, match=r"'w'.*replaced while being read"):
        store.get(1).read_into("w", buffer)
    assert 0xFF not in buffer
    assert buffer[:RANGE] == data[:RANGE]


@pytest.mark.usefixtures("small_blocks")
def test_a_shard_deleted_mid_read_is_missing(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(location, concurrency=1)
    store.save(1, {"w": _data(9 * BLOCK)})
    log = _RangeLog(_driver(store), monkeypatch)
    log.after[1] = lambda: location.remove_shard(store, 1, "w")
    with pytest.raises(ShardMissingError, match="disappeared while being read"):
        store.get(1).read_into("w", bytearray(9 * BLOCK))


@pytest.mark.usefixtures("small_blocks")
def test_a_broken_range_of_a_shard_is_resumed(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(location, concurrency=1)
    data = _data(9 * BLOCK)
    store.save(1, {"w": data})
    answers = _Answers(_driver(store), monkeypatch, [("reset", 1000), ("short", 500)])
    buffer = bytearray(len(data))
    store.get(1).read_into("w", buffer)
    assert bytes(buffer) == data
    assert [first for first, _, _ in answers.requests] == [0, 1000, 1500, RANGE, 2 * RANGE]


def test_a_large_shard_round_trips_with_the_default_sizes(
    location: AzureBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = location.open()  # 4 MiB blocks, 16 MiB ranges, 3 at once (the URL's concurrency)
    values = np.random.default_rng(7).standard_normal(10 * 1024 * 1024 // 4 * 4, np.float32)
    assert values.nbytes == 40 * 1024 * 1024
    store.save(1, {"w": values})
    log = _RangeLog(_driver(store), monkeypatch)
    into = np.empty_like(values)
    store.get(1).read_into("w", into)
    assert into.tobytes() == values.tobytes()  # bitwise
    step = DEFAULT_READ_RANGE_SIZE
    assert sorted(log.calls) == [(s, min(step, values.nbytes - s))
                                 for s in range(0, values.nbytes, step)]  # fmt: skip


# -- the URL options -----------------------------------------------------------------------


def test_read_options_are_taken_and_checked(location: AzureBackend, azurite: EmbeddedAzure) -> None:
    defaults = location.open().strategy.settings()
    assert defaults["read_concurrency"] == 3  # the URL's concurrency
    assert defaults["read_range_size"] == DEFAULT_READ_RANGE_SIZE
    store = location.open(read_concurrency=5, read_range_size=5 * BLOCK)
    assert store.strategy.settings()["read_concurrency"] == 5
    assert store.strategy.settings()["read_range_size"] == 5 * BLOCK
    assert _driver(store).read_concurrency == 5  # and the ranges a stream fetches ahead
    url = azurite.url(f"options-{os.getpid()}", read_concurrency=2, read_range_size=8192)
    settings = ckptstore.open(url, **azurite.options).strategy.settings()
    assert (settings["read_concurrency"], settings["read_range_size"]) == (2, 8192)
    with pytest.raises(InvalidOptionError, match="read_concurrency"):
        location.open(read_concurrency=0)
    with pytest.raises(InvalidOptionError, match="read_range_size"):
        location.open(read_range_size="lots")
    with pytest.raises(InvalidOptionError, match="read_ranges"):
        location.open(read_ranges=4)
