"""Object stores under a hostile clock, server and network (issue 11: items 3, 4, 11, 20-24,
26, 27).

Fast cases run on memory:// with a driver variant that misbehaves one way; the cases about
listings, probes and unsupported operations also run on the moto server behind the S3 proxy
(``tests/s3_proxy.py``), which drops keys from listings, replays stale ones, refuses or resets.
"""

from __future__ import annotations

import io
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from s3_proxy import (
    Action,
    Forward,
    Request,
    Reset,
    Respond,
    Rewrite,
    S3Proxy,
    drop_listed_keys,
    not_implemented,
    slow_down,
)

import ckptstore
from ckptstore import CapabilityError, CheckpointNotFoundError
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket
from ckptstore.cli import main
from ckptstore.commit import conditional_put
from ckptstore.commit.conditional_put import PROBE_PREFIX, ConditionalPutCommit, _probe_body
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.driver import PutMode
from ckptstore.errors import (
    IndeterminateOutcomeError,
    ObjectNotFoundError,
    PreconditionFailedError,
    ShardMissingError,
    TransientStorageError,
)
from ckptstore.store import Store
from ckptstore.tools.embedded import EmbeddedS3

HOUR = 3600.0
GRACE = timedelta(hours=1)
_ids = itertools.count()


@pytest.fixture(autouse=True)
def fresh_conditional_create_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test probes afresh: a proxy's port may be one an earlier test's proxy had."""
    monkeypatch.setattr(
        conditional_put, "_CONDITIONAL_CREATE", conditional_put._ConditionalCreateChecks()
    )


@pytest.fixture
def bucket_name() -> Iterator[str]:
    name = f"hardening-{os.getpid()}-{next(_ids)}"
    yield name
    drop_bucket(name)


# -- memory:// drivers that misbehave one way ------------------------------------------------


class IgnoresIfNoneMatch(MemoryDriver):
    """A server that ignores If-None-Match: * (conditional create) and overwrites."""

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        if kwargs.get("mode") == PutMode.CREATE:
            kwargs["mode"] = PutMode.OVERWRITE
        return super().put(key, data, **kwargs)


class CountsPuts(MemoryDriver):
    """An honest server that counts the puts of probe objects."""

    probes: ClassVar[list[str]] = []

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        if key.startswith(PROBE_PREFIX) and "clock-" not in key:
            self.probes.append(key)
        return super().put(key, data, **kwargs)


class FlakyProbe(MemoryDriver):
    """A server whose ``fail_at``-th probe put fails once: before it takes effect
    (``transient``), or after, with its answer lost (``lost-answer``)."""

    fail_at = 1
    kind = "transient"
    seen: ClassVar[list[str]] = []

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        if key.startswith(PROBE_PREFIX) and "clock-" not in key:
            self.seen.append(key)
            if len(self.seen) == self.fail_at:
                if self.kind == "transient":
                    raise TransientStorageError(f"PutObject {key}: SlowDown", http_status=503)
                try:
                    super().put(key, data, **kwargs)
                except PreconditionFailedError:
                    pass  # refused, but the answer is lost all the same
                raise IndeterminateOutcomeError(104, f"PutObject {key}: connection reset")
        return super().put(key, data, **kwargs)


class RefusesIfMatch(MemoryDriver):
    """A server that refuses If-Match outright: with ``error`` or with a 412 on any etag."""

    error: Exception = PreconditionFailedError("If-Match: precondition failed", http_status=412)

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        if kwargs.get("mode", PutMode.OVERWRITE).kind == "update":
            raise self.error
        return super().put(key, data, **kwargs)


class NoListMultipartUploads(MemoryDriver):
    """A server without ListMultipartUploads, as the S3 driver translates its 501."""

    def list_multipart_uploads(self, prefix: str) -> Iterator[Any]:
        raise TransientStorageError(
            501, "ListMultipartUploads s3://bucket: NotImplemented: not implemented"
        )


def memory_store(
    driver_class: type[MemoryDriver], name: str, *, versioned: bool = False, **settings: Any
) -> Store:
    bucket = get_bucket(name, versioned=versioned, min_part_size=65536, **settings)
    driver = driver_class(bucket, "run")
    strategy_class = VersionPinCommit if versioned else ConditionalPutCommit
    strategy = strategy_class(driver, part_size=65536)
    strategy.open_root(create=True)
    return Store(strategy)


def blob(size: int, seed: int) -> bytes:
    return bytes((seed + i) % 251 for i in range(size))


def probe_keys(name: str) -> list[str]:
    return [key for key in get_bucket(name).objects if PROBE_PREFIX in key]


# -- item 4: GC ages by the storage's clock -------------------------------------------------


def test_gc_on_a_host_two_hours_fast_keeps_a_live_attempt(bucket_name: str) -> None:
    # The storage's clock is 2 h behind this host's: the host is 2 h fast.
    memory_store(MemoryDriver, bucket_name, clock=lambda: time.time() - 2 * HOUR)
    store = ckptstore.open(f"memory://{bucket_name}/run")
    live = store.begin(1)
    live.write("model.bin", blob(1000, 1))
    report = store.gc(grace=GRACE)
    assert report.removed == []
    assert [item.kind for item in report.kept_young] == ["attempt"]
    live.write("optim.bin", blob(1000, 2))
    assert live.publish().step == 1
    assert store.latest().read("model.bin") == blob(1000, 1)
    assert probe_keys(bucket_name) == []  # GC's clock marker is gone


def test_gc_on_a_host_two_hours_slow_still_collects_a_dead_attempt(bucket_name: str) -> None:
    storage_time = [time.time()]
    memory_store(MemoryDriver, bucket_name, clock=lambda: storage_time[0])
    store = ckptstore.open(f"memory://{bucket_name}/run")
    dead = store.begin(1)
    dead.write("model.bin", blob(1000, 1))
    del dead  # its writer died
    storage_time[0] += 2 * HOUR  # two hours pass for the storage; this host's clock stands
    report = store.gc(grace=GRACE, dry_run=False)
    assert [item.kind for item in report.removed] == ["attempt"]
    assert report.removed[0].age_s == pytest.approx(2 * HOUR, abs=60)
    assert store.is_empty() or set(get_bucket(bucket_name).objects) <= {"run/LATEST"}


def test_gc_on_s3_with_a_host_two_hours_fast_keeps_a_live_attempt(
    moto_s3: EmbeddedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fast() -> float:
        return time.time() + 2 * HOUR

    monkeypatch.setattr(conditional_put, "_host_clock", fast, raising=False)
    url = moto_s3.url(f"skew-{os.getpid()}-{next(_ids)}", part_size=65536)
    writer = ckptstore.open(url, **moto_s3.options)
    live = writer.begin(1)
    live.write("model.bin", blob(1000, 1))
    gc_host = ckptstore.open(url, clock=fast, **moto_s3.options)
    assert gc_host.gc(grace=GRACE).removed == []
    live.write("optim.bin", blob(1000, 2))
    assert live.publish().step == 1


def test_a_writer_whose_attempt_gc_removed_is_told_so(bucket_name: str) -> None:
    memory_store(MemoryDriver, bucket_name)
    writer = ckptstore.open(f"memory://{bucket_name}/run")
    stalled = writer.begin(1)
    stalled.write("model.bin", blob(1000, 1))
    later = ckptstore.open(f"memory://{bucket_name}/run", clock=lambda: time.time() + 2 * HOUR)
    assert [item.kind for item in later.gc(grace=GRACE).removed] == ["attempt"]
    with pytest.raises(ShardMissingError, match=r"removed by garbage collection.*grace period"):
        stalled.publish()
    assert writer.steps() == []


def test_a_writer_whose_upload_gc_aborted_is_told_so(bucket_name: str) -> None:
    memory_store(MemoryDriver, bucket_name)
    writer = ckptstore.open(f"memory://{bucket_name}/run?part_size=65536")
    stalled = writer.begin(1)
    shard = stalled.open_shard("model.bin")
    shard.write(blob(200_000, 1))  # parts of a multipart upload
    later = ckptstore.open(f"memory://{bucket_name}/run", clock=lambda: time.time() + 2 * HOUR)
    assert [item.kind for item in later.gc(grace=GRACE).removed] == ["attempt"]
    with pytest.raises(ObjectNotFoundError, match="removed by garbage collection"):
        shard.write(blob(200_000, 2))
    with pytest.raises(ObjectNotFoundError, match="removed by garbage collection"):
        shard.close()
    assert writer.steps() == []


# -- items 11 and 21: readers write nothing; a writer verifies before its first publish -------


def test_a_handle_opened_without_create_cannot_publish_on_storage_ignoring_the_condition(
    bucket_name: str,
) -> None:
    get_bucket(bucket_name, min_part_size=65536)
    strategy = ConditionalPutCommit(IgnoresIfNoneMatch(get_bucket(bucket_name), "run"))
    strategy.open_root(create=False)  # what ckptstore.open(url, create=False) does
    store = Store(strategy)
    with pytest.raises(CapabilityError, match="If-None-Match"):
        store.save(1, {"model.bin": b"mine"})
    assert store.steps() == []
    assert probe_keys(bucket_name) == []


def test_racing_writers_on_storage_ignoring_the_condition_are_both_refused(
    bucket_name: str,
) -> None:
    get_bucket(bucket_name)
    outcomes: list[str] = []

    def save(seed: int) -> None:
        strategy = ConditionalPutCommit(IgnoresIfNoneMatch(get_bucket(bucket_name), "run"))
        strategy.open_root(create=False)
        try:
            Store(strategy).save(1, {"model.bin": blob(100, seed)})
        except CapabilityError:
            outcomes.append("refused")
        else:
            outcomes.append("won")

    threads = [threading.Thread(target=save, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == ["refused", "refused"]


def test_conditional_create_is_verified_once_per_process_and_bucket(bucket_name: str) -> None:
    CountsPuts.probes = []
    for step in (1, 2):
        memory_store(CountsPuts, bucket_name).save(step, {"a": b"x"})
    assert len(set(CountsPuts.probes)) == 1  # one probe object (two puts of it)
    reader = memory_store(CountsPuts, bucket_name)
    assert reader.latest().step == 2
    assert len(set(CountsPuts.probes)) == 1


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_a_refused_probe_leaves_no_probe_version(bucket_name: str, versioned: bool) -> None:
    store = memory_store(IgnoresIfNoneMatch, bucket_name, versioned=versioned)
    with pytest.raises(CapabilityError, match="ignored If-None-Match"):
        store.begin(1)
    assert probe_keys(bucket_name) == []  # every version of it deleted
    with pytest.raises(CapabilityError):  # remembered: no second probe
        store.begin(2)
    assert probe_keys(bucket_name) == []


@pytest.mark.parametrize("fail_at", [1, 2], ids=["first-put", "second-put"])
@pytest.mark.parametrize("kind", ["transient", "lost-answer"])
def test_the_probe_of_a_writer_is_retried(
    bucket_name: str, fail_at: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FlakyProbe, "fail_at", fail_at)
    monkeypatch.setattr(FlakyProbe, "kind", kind)
    monkeypatch.setattr(FlakyProbe, "seen", [])
    store = memory_store(FlakyProbe, bucket_name)
    assert store.save(1, {"model.bin": b"weights"}).step == 1
    assert len(FlakyProbe.seen) == 3  # the failed put was tried again
    assert probe_keys(bucket_name) == []


def _writes(proxy: S3Proxy) -> list[Request]:
    return [r for r in proxy.requests if r.method in ("PUT", "POST", "DELETE")]


def _read_everything(url: str, options: dict[str, Any]) -> None:
    for create in (True, False):
        store = ckptstore.open(url, create=create, **options)
        latest = store.latest()
        assert latest is not None and latest.step == 2
        assert latest.read("model.bin") == blob(5000, 2)
        assert latest.verify().ok
        assert store.steps() == [1, 2]
        assert [c.step for c in store.checkpoints()] == [1, 2]
        assert store.get(1).read("model.bin") == blob(5000, 1)


def test_a_reader_writes_nothing(moto_s3: EmbeddedS3) -> None:
    with S3Proxy(moto_s3) as proxy:
        server = proxy.through(moto_s3)
        url = server.url(f"reader-{os.getpid()}-{next(_ids)}", part_size=65536)
        writer = ckptstore.open(url, **server.options)
        for step in (1, 2):
            writer.save(step, {"model.bin": blob(5000, step)})
        proxy.requests.clear()
        _read_everything(url, server.options)
        assert _writes(proxy) == []


def test_a_reader_with_read_only_credentials_can_open_and_read(moto_s3: EmbeddedS3) -> None:
    denied = Respond(
        403,
        b"<Error><Code>AccessDenied</Code><Message>read-only</Message></Error>",
        {"Content-Type": "application/xml"},
    )
    read_only = [False]

    def rule(request: Request) -> Action:
        if read_only[0] and request.method in ("PUT", "POST", "DELETE"):
            return denied
        return Forward()

    with S3Proxy(moto_s3, rule) as proxy:
        server = proxy.through(moto_s3)
        url = server.url(f"read-only-{os.getpid()}-{next(_ids)}", part_size=65536)
        writer = ckptstore.open(url, **server.options)
        for step in (1, 2):
            writer.save(step, {"model.bin": blob(5000, step)})
        read_only[0] = True
        _read_everything(url, server.options)


def _probe_put(request: Request) -> bool:
    return request.method == "PUT" and PROBE_PREFIX in request.path and "clock-" not in request.path


def _nth(
    when: Callable[[Request], bool], n: int, action: Action, fired: list[Request]
) -> Callable[[Request], Action]:
    """A rule applying ``action`` to the ``n``-th request ``when`` selects (from 1), only;
    ``fired`` receives that request."""
    seen = [0]
    lock = threading.Lock()

    def rule(request: Request) -> Action:
        with lock:
            if when(request):
                seen[0] += 1
                if seen[0] == n:
                    fired.append(request)
                    return action
        return Forward()

    return rule


@pytest.mark.parametrize("which", [1, 2], ids=["first-put", "second-put"])
@pytest.mark.parametrize(
    "fault",
    [slow_down(), Reset(), Reset(after_upstream=True)],
    ids=["503", "reset", "reset-after-effect"],
)
def test_the_probe_of_a_writer_survives_one_fault(
    moto_s3: EmbeddedS3, which: int, fault: Action
) -> None:
    fired: list[Request] = []
    with S3Proxy(moto_s3, _nth(_probe_put, which, fault, fired)) as proxy:
        server = proxy.through(moto_s3)
        prefix = f"probe-{os.getpid()}-{next(_ids)}"
        store = ckptstore.open(server.url(prefix, part_size=65536), **server.options)
        store.save(1, {"model.bin": b"weights"})
        assert len(fired) == 1  # the probe met its fault, and the save went on
        assert store.latest().read("model.bin") == b"weights"
    listed = moto_s3.client().list_objects_v2(Bucket=moto_s3.bucket, Prefix=f"{prefix}/")
    assert [o["Key"] for o in listed.get("Contents", []) if PROBE_PREFIX in o["Key"]] == []


# -- item 20: a server without ListMultipartUploads -----------------------------------------


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_gc_works_without_list_multipart_uploads(bucket_name: str, versioned: bool) -> None:
    store = memory_store(NoListMultipartUploads, bucket_name, versioned=versioned)
    store.save(1, {"model.bin": blob(1000, 1)})
    dead = store.begin(2)
    dead.write("model.bin", blob(1000, 2))
    del dead
    aborted = store.begin(3)
    aborted.write("model.bin", blob(1000, 3))
    aborted.abort()  # abort cleans up what it can list
    store.clock = lambda: time.time() + 2 * HOUR
    report = store.gc(grace=GRACE)
    assert report.removed
    assert report.missing_operations == ["ListMultipartUploads"]
    assert "lifecycle" in report.warnings[0]
    assert store.latest().read("model.bin") == blob(1000, 1)
    assert store.gc(grace=GRACE).removed == []


def test_gc_through_a_server_answering_501_to_list_multipart_uploads(
    moto_s3: EmbeddedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rule(request: Request) -> Action:
        if request.method == "GET" and "uploads" in request.query:
            return not_implemented()
        return Forward()

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret_key)
    with S3Proxy(moto_s3, rule) as proxy:
        server = proxy.through(moto_s3)
        url = server.url(f"no-uploads-{os.getpid()}-{next(_ids)}", part_size=65536)
        store = ckptstore.open(url, **server.options)
        store.save(1, {"model.bin": blob(1000, 1)})
        dead = store.begin(2)
        dead.write("model.bin", blob(1000, 2))
        del dead
        later = ckptstore.open(url, clock=lambda: time.time() + 2 * HOUR, **server.options)
        report = later.gc(grace=GRACE, dry_run=True)
        assert [item.kind for item in report.removed] == ["attempt"]
        assert report.missing_operations == ["ListMultipartUploads"]
        printed = io.StringIO()
        status = main(["gc", url, "--grace", "0s"], printed)
        assert status == 0
        assert "warning:" in printed.getvalue() and "lifecycle" in printed.getvalue()
        assert store.latest().read("model.bin") == blob(1000, 1)


# -- item 23: a server refusing If-Match is not contention ----------------------------------


@pytest.mark.parametrize(
    "error",
    [
        PreconditionFailedError("If-Match: precondition failed", http_status=412),
        TransientStorageError("PutObject LATEST (If-Match): NotImplemented", http_status=501),
        ObjectNotFoundError(2, "unused"),  # replaced below: a 400 for the header
    ],
    ids=["412-on-any-etag", "501", "400"],
)
def test_a_refused_if_match_is_reported_as_such(
    bucket_name: str, error: Exception, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    from ckptstore.errors import StorageError

    if isinstance(error, ObjectNotFoundError):
        error = StorageError(
            "PutObject LATEST (If-Match): InvalidArgument: If-Match", http_status=400
        )
    monkeypatch.setattr(RefusesIfMatch, "error", error)
    store = memory_store(RefusesIfMatch, bucket_name)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            store.save(step, {"a": b"x"})
    text = caplog.text
    assert "contended" not in text
    assert "refused the conditional write itself, which is not contention" in text
    assert str(error).split(":")[-1].strip() in text
    assert store.latest().step == 3  # readers list past the stale hint


def test_a_server_answering_501_to_if_match_is_reported_as_such(
    moto_s3: EmbeddedS3, caplog: pytest.LogCaptureFixture
) -> None:
    def rule(request: Request) -> Action:
        headers = {k.lower() for k in request.headers}
        if request.method == "PUT" and request.path.endswith("/LATEST") and "if-match" in headers:
            return not_implemented()
        return Forward()

    with S3Proxy(moto_s3, rule) as proxy:
        server = proxy.through(moto_s3)
        url = server.url(f"cas-{os.getpid()}-{next(_ids)}", part_size=65536)
        store = ckptstore.open(url, **server.options)
        with caplog.at_level(logging.WARNING):
            for step in (1, 2):
                store.save(step, {"a": b"x"})
        assert "not contention" in caplog.text and "NotImplemented" in caplog.text
        assert "contended" not in caplog.text
        assert store.latest().step == 2


# -- item 24: GC reports the bytes of the uploads it aborts ----------------------------------


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_gc_reports_the_parts_of_an_aborted_upload(bucket_name: str, versioned: bool) -> None:
    store = memory_store(MemoryDriver, bucket_name, versioned=versioned)
    dead = store.begin(1)
    shard = dead.open_shard("model.bin")
    shard.write(blob(300_000, 1))  # four parts of 64 KiB uploaded, 37,856 bytes buffered
    del shard, dead
    store.clock = lambda: time.time() + 2 * HOUR
    report = store.gc(grace=GRACE)
    assert len(report.removed) == 1
    assert report.removed_bytes == 4 * 65536


def test_gc_reports_the_parts_of_an_aborted_upload_on_s3(moto_s3: EmbeddedS3) -> None:
    url = moto_s3.url(f"parts-{os.getpid()}-{next(_ids)}", part_size=65536)
    store = ckptstore.open(url, **moto_s3.options)
    dead = store.begin(1)
    shard = dead.open_shard("model.bin")
    shard.write(blob(300_000, 1))
    del shard, dead
    later = ckptstore.open(url, clock=lambda: time.time() + 2 * HOUR, **moto_s3.options)
    report = later.gc(grace=GRACE)
    assert [item.kind for item in report.removed] == ["attempt"]
    assert report.removed_bytes == 4 * 65536


# -- item 26: a writer never trusts a listing ------------------------------------------------


def _is_listing(request: Request) -> bool:
    return request.method == "GET" and (
        request.query.get("list-type") == "2" or "versions" in request.query
    )


def _drop_versions(drop: Callable[[str], bool]) -> Callable[[bytes], bytes]:
    """An edit removing ListObjectVersions entries whose key ``drop`` selects (and ending it)."""

    def edit(body: bytes) -> bytes:
        def entry(match: re.Match[bytes]) -> bytes:
            key = re.search(rb"<Key>([^<]*)</Key>", match.group(0))
            return b"" if key and drop(key.group(1).decode()) else match.group(0)

        body = re.sub(rb"<(Version|DeleteMarker)>.*?</\1>", entry, body, flags=re.S)
        return body.replace(b"<IsTruncated>true</IsTruncated>", b"<IsTruncated>false</IsTruncated>")

    return edit


def _hiding(drop: Callable[[str], bool]) -> Callable[[Request], Action]:
    """A rule whose listings (both kinds) never show the keys ``drop`` selects."""
    objects, versions = drop_listed_keys(drop), _drop_versions(drop)

    def rule(request: Request) -> Action:
        if not _is_listing(request):
            return Forward()
        return Rewrite(versions if "versions" in request.query else objects)

    return rule


def _shards(count: int, seed: int) -> dict[str, bytes]:
    return {f"model/rank{rank:02d}.bin": blob(3000 + rank, seed + rank) for rank in range(count)}


@pytest.mark.parametrize("scheme", ["s3", "s3+versioned"])
def test_saves_succeed_while_listings_never_show_the_new_data(
    moto_s3: EmbeddedS3, scheme: str
) -> None:
    base = moto_s3.versioned_bucket("hardening-versioned") if scheme != "s3" else moto_s3

    def is_data(key: str) -> bool:
        return "/shards/" in key or re.search(r"/step-\d{20}\.[0-9a-z]+/", key) is not None

    with S3Proxy(base, _hiding(is_data)) as proxy:
        server = proxy.through(base)
        url = server.url(f"lag-{os.getpid()}-{next(_ids)}", scheme=scheme, part_size=65536)
        store = ckptstore.open(url, **server.options)
        for step in (1, 2):
            store.save(step, _shards(5, step))
        latest = store.latest()
        assert latest is not None and latest.step == 2
        assert latest.read("model/rank04.bin") == _shards(5, 2)["model/rank04.bin"]


@pytest.mark.parametrize("scheme", ["s3", "s3+versioned"])
def test_a_stale_listing_cannot_make_a_writer_publish_missing_data(
    moto_s3: EmbeddedS3, scheme: str
) -> None:
    base = moto_s3.versioned_bucket("hardening-versioned") if scheme != "s3" else moto_s3
    listing: dict[str, bytes] = {}

    def record(body: bytes) -> bytes:
        listing["body"] = body
        return body

    def rule(request: Request) -> Action:
        if not _is_listing(request) or "mode" not in listing:
            return Forward()
        if listing["mode"] == b"record":
            return Rewrite(record)
        return Respond(200, listing["body"], {"Content-Type": "application/xml"})

    with S3Proxy(base, rule) as proxy:
        server = proxy.through(base)
        prefix = f"stale-{os.getpid()}-{next(_ids)}"
        store = ckptstore.open(server.url(prefix, scheme=scheme, part_size=65536), **server.options)
        pending = store.begin(1)
        for name, data in _shards(5, 1).items():
            pending.write(name, data)
        driver = store.strategy.driver
        listing["mode"] = b"record"  # the listing as it stands once every shard is written
        if scheme == "s3":
            list(driver.list(f"step-{1:020d}.{pending.attempt}/"))
        else:
            list(driver.list_versions("shards/"))
        listing["mode"] = b"replay"  # ... and as a lagging server keeps answering it
        record_ = pending.records[0]
        base.client().delete_object(  # then a GC removes a shard
            Bucket=base.bucket, Key=f"{prefix}/{record_.locator['key']}", **_version_arg(record_)
        )
        with pytest.raises(ShardMissingError, match="removed by garbage collection"):
            pending.publish()
        del listing["mode"]
        assert store.steps() == []


def _version_arg(locator_of: Any) -> dict[str, str]:
    version = locator_of.locator.get("version_id")
    return {"VersionId": version} if version else {}


# -- item 27: GC never removes what a manifest references, whatever a listing says ----------


@pytest.mark.parametrize("scheme", ["s3", "s3+versioned"])
def test_gc_keeps_a_published_checkpoint_that_listings_do_not_show(
    moto_s3: EmbeddedS3, scheme: str
) -> None:
    base = moto_s3.versioned_bucket("hardening-versioned") if scheme != "s3" else moto_s3
    hidden = [False]
    hide = _hiding(lambda key: key.endswith("/manifests/step-00000000000000000002.json"))

    def rule(request: Request) -> Action:
        return hide(request) if hidden[0] else Forward()

    with S3Proxy(base, rule) as proxy:
        server = proxy.through(base)
        url = server.url(f"hidden-{os.getpid()}-{next(_ids)}", scheme=scheme, part_size=65536)
        store = ckptstore.open(url, **server.options)
        for step in (1, 2, 3):
            store.save(step, _shards(2, step))
        dead = store.begin(4)
        dead.write("model/rank00.bin", blob(100, 4))
        del dead
        hidden[0] = True
        later = ckptstore.open(url, clock=lambda: time.time() + 2 * HOUR, **server.options)
        report = later.gc(grace=GRACE)
        assert report.removed  # the dead attempt went
        assert "step-00000000000000000002" not in " ".join(i.name for i in report.removed)
        hidden[0] = False
        assert store.steps() == [1, 2, 3]
        for step in (1, 2, 3):
            checkpoint = store.get(step)
            assert checkpoint.verify().ok
            assert checkpoint.read("model/rank01.bin") == _shards(2, step)["model/rank01.bin"]
        assert later.gc(grace=GRACE).removed == []


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_gc_confirms_each_removal_by_reading_the_manifest(
    bucket_name: str, versioned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = memory_store(MemoryDriver, bucket_name, versioned=versioned)
    for step in (1, 2):
        store.save(step, _shards(2, step))
    strategy = store.strategy
    monkeypatch.setattr(strategy, "published_checkpoints", lambda min_step=0: [])  # empty
    if versioned:  # and a version listing that shows no manifest
        listing = strategy.driver.list_versions
        monkeypatch.setattr(
            strategy.driver,
            "list_versions",
            lambda prefix: iter([v for v in listing(prefix) if "manifests/" not in v.key]),
        )
    store.clock = lambda: time.time() + 2 * HOUR
    removed = store.gc(grace=GRACE).removed
    assert [item.kind for item in removed] in ([], ["old-version"])  # an old LATEST at most
    monkeypatch.undo()
    for step in (1, 2):
        assert store.get(step).verify().ok


# -- item 3: a manifest gone is "not found", not missing shards -----------------------------


@pytest.mark.parametrize("versioned", [False, True], ids=["plain", "versioned"])
def test_shard_problems_of_an_unpublished_step_is_not_found(
    bucket_name: str, versioned: bool
) -> None:
    store = memory_store(MemoryDriver, bucket_name, versioned=versioned)
    store.save(1, {"a": b"x"})
    store.save(2, {"a": b"y"})
    manifest = store.strategy.read_manifest(1)
    store.strategy.unpublish(1)  # a retention pass, between a reader's two reads
    with pytest.raises(CheckpointNotFoundError, match="unpublished while it was being read"):
        store.strategy.shard_problems(manifest)
    damaged = store.strategy.read_manifest(2)
    store.strategy.driver.delete(damaged.shards[0].locator["key"], **_version_kwargs(damaged))
    assert [p.missing for p in store.strategy.shard_problems(damaged)] == [True]


def _version_kwargs(manifest: Any) -> dict[str, str]:
    version = manifest.shards[0].locator.get("version_id")
    return {"version_id": version} if version else {}


# -- review: versioned GC never uncovers an unpublished manifest -----------------------------


class DiesInUnpublish(MemoryDriver):
    """A writer that dies during its ``die_at``-th delete of a manifest key (after it)."""

    die_at = 1

    def delete(self, key: str, *, version_id: str | None = None) -> None:
        super().delete(key, version_id=version_id)
        if key.startswith("manifests/"):
            self.die_at -= 1
            if self.die_at == 0:
                raise RuntimeError("the process died")


def _manifest_versions(store: Store, step: int) -> list[tuple[bool, bool]]:
    """(is_delete_marker, is_latest) of each stored version of ``step``'s manifest."""
    key = store.strategy.manifest_key(step)
    return [
        (v.is_delete_marker, v.is_latest)
        for v in store.strategy.driver.list_versions(key)
        if v.key == key
    ]


@pytest.mark.parametrize("die_at", [1, 2], ids=["after-the-marker", "after-a-version-delete"])
@pytest.mark.parametrize("operation", ["delete", "rollback-then-gc"])
def test_versioned_gc_never_republishes_an_interrupted_unpublish(
    bucket_name: str, die_at: int, operation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = memory_store(DiesInUnpublish, bucket_name, versioned=True)
    for step in (1, 2):
        store.save(step, {"model.bin": blob(1000, step)})
    if operation != "delete":  # a rollback unpublishes nothing: GC does, after the grace
        store.rollback(1)
    monkeypatch.setattr(store.strategy.driver, "die_at", die_at)
    with pytest.raises(RuntimeError, match="died"):
        if operation == "delete":
            store.delete(2, force=True)
        else:
            store.gc(grace=GRACE, superseded_grace=0)
    assert store.steps() == [1]
    store.clock = lambda: time.time() + 2 * HOUR
    for _ in range(2):  # the marker goes once nothing is left below it, maybe a pass later
        store.gc(grace=GRACE)
        assert store.steps() == [1]
        assert store.latest().step == 1
    assert _manifest_versions(store, 2) == []
    assert store.get(1).read("model.bin") == blob(1000, 1)


def test_versioned_gc_keeps_a_marker_whose_hidden_versions_another_page_lists(
    bucket_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = memory_store(MemoryDriver, bucket_name, versioned=True)
    for step in (1, 2):
        store.save(step, {"model.bin": blob(1000, step)})
    store.strategy.driver.delete(store.strategy.manifest_key(2))  # an unpublish, interrupted
    listing = store.strategy.driver.list_versions
    monkeypatch.setattr(  # GC's listing shows the marker, not the version below it
        store.strategy.driver,
        "list_versions",
        lambda prefix: iter(
            [
                v
                for v in listing(prefix)
                if prefix or not v.key.startswith("manifests/") or v.is_delete_marker
            ]
        ),
    )
    store.clock = lambda: time.time() + 2 * HOUR
    report = store.gc(grace=GRACE)
    assert "delete-marker" not in [item.kind for item in report.removed]
    monkeypatch.undo()
    assert _manifest_versions(store, 2) == [(True, True), (False, False)]
    assert store.steps() == [1]
    store.gc(grace=GRACE)
    store.gc(grace=GRACE)
    assert store.steps() == [1]
    assert _manifest_versions(store, 2) == []


def _manifest_versions_on_another_page(request: Request) -> Action:
    """A rule whose store-wide version listings end before the versions of step 2's
    manifest (only its delete marker is on the page); a listing of that key shows all."""
    manifest = "/manifests/step-00000000000000000002.json"

    def edit(body: bytes) -> bytes:
        def entry(match: re.Match[bytes]) -> bytes:
            return b"" if manifest.encode() in match.group(0) else match.group(0)

        return re.sub(rb"<Version>.*?</Version>", entry, body, flags=re.S)

    whole_store = "versions" in request.query and request.query.get("prefix", "").endswith("/")
    return Rewrite(edit) if request.method == "GET" and whole_store else Forward()


def test_versioned_gc_on_s3_never_republishes_an_interrupted_unpublish(
    moto_s3: EmbeddedS3,
) -> None:
    base = moto_s3.versioned_bucket("hardening-versioned")
    with S3Proxy(base, _manifest_versions_on_another_page) as proxy:
        server = proxy.through(base)
        prefix = f"unpublish-{os.getpid()}-{next(_ids)}"
        url = server.url(prefix, scheme="s3+versioned", part_size=65536)
        store = ckptstore.open(url, **server.options)
        for step in (1, 2):
            store.save(step, {"model.bin": blob(1000, step)})
        # An unpublish that died right after its delete marker.
        base.client().delete_object(
            Bucket=base.bucket, Key=f"{prefix}/{store.strategy.manifest_key(2)}"
        )
        later = ckptstore.open(url, clock=lambda: time.time() + 2 * HOUR, **server.options)
        later.gc(grace=GRACE)
        assert later.steps() == [1]
        assert later.latest().step == 1
        assert later.get(1).read("model.bin") == blob(1000, 1)
        assert sorted(m for m, _ in _manifest_versions(later, 2)) == [False, True]  # both stay


# -- review: the probe counts only a 412 the server sent ------------------------------------


def _ignoring_the_condition(
    store: Store, monkeypatch: pytest.MonkeyPatch, fail: Callable[[int], bool]
) -> list[bytes]:
    """Make ``store``'s S3 client ignore If-None-Match, and fail the n-th probe put (from 1)
    with a connect timeout, before it is sent, when ``fail(n)``; returns the probe bodies."""
    from botocore.exceptions import ConnectTimeoutError

    client = store.strategy.driver.client  # type: ignore[attr-defined]
    put_object = client.put_object
    probes: list[bytes] = []

    def put(**args: Any) -> Any:
        args.pop("IfNoneMatch", None)  # the storage ignores the condition
        if PROBE_PREFIX in args["Key"] and "clock-" not in args["Key"]:
            probes.append(args["Body"])
            if fail(len(probes)):
                raise ConnectTimeoutError(endpoint_url=str(client.meta.endpoint_url))
        return put_object(**args)

    monkeypatch.setattr(client, "put_object", put)
    return probes


def test_the_probe_is_not_fooled_by_a_refusal_read_back_after_a_broken_call(
    moto_s3: EmbeddedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = moto_s3.url(f"inferred-{os.getpid()}-{next(_ids)}", part_size=65536)
    store = ckptstore.open(url, **moto_s3.options)
    probes = _ignoring_the_condition(store, monkeypatch, lambda n: n == 2)
    with pytest.raises(CapabilityError, match="ignored If-None-Match"):
        store.save(1, {"model.bin": b"weights"})
    first, second = _probe_body(1), _probe_body(2)
    # The second create was sent again, and let through; a second probe (a fresh key)
    # confirmed the verdict before the process remembered it.
    assert probes == [first, second, second, first, second]
    assert store.steps() == []


def test_a_probe_without_an_answer_from_the_server_decides_nothing(
    moto_s3: EmbeddedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = moto_s3.url(f"no-answer-{os.getpid()}-{next(_ids)}", part_size=65536)
    store = ckptstore.open(url, **moto_s3.options)
    broken = [True]
    _ignoring_the_condition(store, monkeypatch, lambda n: broken[0] and n >= 2)
    with pytest.raises(TransientStorageError, match="no answer from the storage itself"):
        store.save(1, {"model.bin": b"weights"})
    assert store.steps() == []
    broken[0] = False  # no verdict was cached: the next save probes again
    with pytest.raises(CapabilityError, match="ignored If-None-Match"):
        store.save(1, {"model.bin": b"weights"})
    assert store.steps() == []


# -- review: a caller's clock behind this host's counts as none -----------------------------


def test_gc_with_a_caller_clock_behind_this_host_still_collects_a_dead_attempt(
    bucket_name: str,
) -> None:
    storage_time = [time.time()]
    memory_store(MemoryDriver, bucket_name, clock=lambda: storage_time[0])
    store = ckptstore.open(f"memory://{bucket_name}/run", clock=lambda: time.time() - 2 * HOUR)
    dead = store.begin(1)
    dead.write("model.bin", blob(1000, 1))
    del dead  # its writer died
    storage_time[0] += 2 * HOUR  # two hours pass for the storage
    report = store.gc(grace=GRACE)
    assert [item.kind for item in report.removed] == ["attempt"]
    assert report.removed[0].age_s == pytest.approx(2 * HOUR, abs=60)
