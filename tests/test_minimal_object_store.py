"""A new object-store backend written against ObjectStoreBase (tests/minimal_object_store.py)
is small and passes the conformance suite; the base's retries, read-back of a lost create,
resumed reads and error table work for it as for the real drivers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from minimal_object_store import SERVICES, MinimalDriver, open_minimal
from minimal_service import MinimalService

import ckptstore
from ckptstore.conformance.runner import run_backend
from ckptstore.driver import PutMode
from ckptstore.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    PreconditionInferredError,
    TransientStorageError,
)
from ckptstore.registry import register, unregister


@pytest.fixture
def minimal_url() -> Iterator[str]:
    register("minimal", open_minimal)
    bucket = f"minimal-{os.getpid()}"
    yield f"minimal://{bucket}/run"
    unregister("minimal")
    SERVICES.pop(bucket, None)


def test_the_backend_is_small() -> None:
    backend = Path(__file__).with_name("minimal_object_store.py")
    assert len(backend.read_text().splitlines()) < 250


def test_a_backend_on_the_base_passes_the_conformance_suite(minimal_url: str) -> None:
    report = run_backend(minimal_url)
    assert report.ok, report
    assert {key: result.status for key, result in report.invariants.items()} == dict.fromkeys(
        [f"I{i}" for i in range(1, 11)], "held"
    )


def test_a_store_on_it_saves_and_reads_through_faults(minimal_url: str) -> None:
    store = ckptstore.open(minimal_url)
    service = SERVICES[minimal_url.split("/")[2]]
    service.refuse, service.lose_answers = 2, 1  # retried; a lost answer read back
    store.save(1, {"a": b"x" * 5000})  # five parts
    service.break_bodies = 3  # every read resumed from the byte reached
    assert store.latest().read("a") == b"x" * 5000
    store.close()


@pytest.fixture
def driver() -> MinimalDriver:
    return MinimalDriver(MinimalService(), "bucket", "prefix")


def test_a_refused_request_is_retried_and_then_given_up(driver: MinimalDriver) -> None:
    driver.service.refuse = 4
    driver.put("k", b"v")  # the fifth try
    driver.service.refuse = 5
    with pytest.raises(TransientStorageError, match="SlowDown"):
        driver.put("k", b"v")


def test_a_create_whose_answer_was_lost_is_read_back(driver: MinimalDriver) -> None:
    driver.service.lose_answers = 1
    info = driver.put("k", b"mine", mode=PutMode.CREATE)  # not sent again: read back
    assert driver.get("k") == (b"mine", driver.head("k")) and info.etag == driver.head("k").etag
    driver.service.lose_answers = 1
    with pytest.raises(PreconditionFailedError):
        driver.put("k", b"mine", mode=PutMode.CREATE)  # refused: not in doubt
    driver.put("k2", b"theirs")
    driver.service.refuse = 1  # a 503: in doubt, read back
    with pytest.raises(PreconditionInferredError):  # another writer's bytes, no 412 seen
        driver.put("k2", b"mine", mode=PutMode.CREATE)


def test_a_broken_body_is_resumed_from_the_same_object(driver: MinimalDriver) -> None:
    driver.put("k", bytes(range(256)) * 40)
    driver.service.break_bodies = 2
    with driver.open_read("k") as stream:
        assert stream.read() == bytes(range(256)) * 40


def test_the_service_errors_are_translated_by_its_table(driver: MinimalDriver) -> None:
    with pytest.raises(ObjectNotFoundError, match="NoSuchKey"):
        driver.head("missing")
    first = driver.put("k", b"1")
    driver.put("k", b"2")
    with pytest.raises(PreconditionFailedError, match="PreconditionFailed"):
        driver.put("k", b"3", mode=PutMode.update(first.etag))
