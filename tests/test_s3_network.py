"""The S3 driver on a flaky or unusual network: a real moto (or SeaweedFS) server behind a
fault-injecting proxy on 127.0.0.1 (tests/s3_proxy.py). No mocks: every request is HTTP."""

from __future__ import annotations

import errno
import http.client
import logging
import os
import random
import threading
from collections.abc import Iterator

import pytest
import urllib3.exceptions
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from s3_proxy import (
    Action,
    Delay,
    Forward,
    Request,
    Reset,
    Respond,
    Rewrite,
    Rule,
    S3Proxy,
    Truncate,
    blank_etag,
    drop_listed_keys,
    not_implemented,
    once,
    slow_down,
)

import ckptstore
from ckptstore.backends.s3 import S3Driver
from ckptstore.backends.s3_errors import translate_s3_errors
from ckptstore.driver import PutMode
from ckptstore.errors import (
    IndeterminateOutcomeError,
    InvalidOptionError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageAccessDeniedError,
    StorageError,
    TransientStorageError,
)
from ckptstore.store import Store
from ckptstore.tools.embedded import EmbeddedS3

KiB, MiB = 1024, 1024 * 1024
_runs = iter(range(1_000_000))


def _prefix(name: str) -> str:
    return f"net-{name}-{os.getpid()}-{next(_runs)}"


def _open(server: EmbeddedS3, prefix: str, **query: int) -> Store:
    """A writer's store on ``server`` (a proxied one: its endpoint is the proxy's)."""
    url = server.url(prefix, "s3", **{"part_size": 64 * KiB, "concurrency": 3, **query})
    return ckptstore.open(url, **server.options)


def _driver(store: Store) -> S3Driver:
    driver = store.strategy.driver
    assert isinstance(driver, S3Driver)
    return driver


def _data(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _save_streamed(store: Store, step: int, shards: dict[str, bytes]) -> None:
    """Save shards written in 16 KiB pieces, without a size hint: streamed shards larger than
    the part size (64 KiB here) go up as multipart uploads of part-size parts."""
    with store.begin(step) as pending:
        for name, data in shards.items():
            with pending.open_shard(name) as writer:
                for offset in range(0, len(data), 16 * KiB):
                    writer.write(data[offset : offset + 16 * KiB])


def _describe(value: object) -> str:
    """A test id for an operation name or a proxy action."""
    if isinstance(value, Respond):
        return f"answer-{value.status}"
    if isinstance(value, Reset):
        return "reset-after-upstream" if value.after_upstream else "reset"
    if isinstance(value, Truncate):
        return f"{'reset' if value.reset else 'closed'}-after-{value.after_bytes}-bytes"
    return str(value)


@pytest.fixture
def proxy(moto_s3: EmbeddedS3) -> Iterator[S3Proxy]:
    """A pass-through proxy to the moto server; tests set ``proxy.rule``."""
    with S3Proxy(moto_s3) as running:
        yield running


# -- the proxy itself -------------------------------------------------------------------------


def test_the_proxy_passes_requests_through_and_leaves_no_thread(moto_s3: EmbeddedS3) -> None:
    before = set(threading.enumerate())
    with S3Proxy(moto_s3) as proxy:
        client = proxy.through(moto_s3).client()
        client.put_object(Bucket=moto_s3.bucket, Key="proxy/a", Body=b"hello")
        assert client.get_object(Bucket=moto_s3.bucket, Key="proxy/a")["Body"].read() == b"hello"
        assert [r.operation for r in proxy.requests] == ["PutObject", "GetObject"]
        client.put_object(Bucket=moto_s3.bucket, Key="proxy/b", Body=b"")
        short = Rewrite(drop_listed_keys(lambda key: key.endswith("/a")))
        proxy.rule = lambda r: short if r.operation == "ListObjectsV2" else not_implemented()
        listed = client.list_objects_v2(Bucket=moto_s3.bucket, Prefix="proxy/", MaxKeys=1)
        keys = [o["Key"] for o in listed.get("Contents", [])]
        assert (keys, listed["IsTruncated"]) == ([], False)  # a listing that ended early
        with pytest.raises(ClientError, match="NotImplemented"):
            client.get_bucket_versioning(Bucket=moto_s3.bucket)
    assert set(threading.enumerate()) <= before  # keep-alive connections included


# -- item 9: a connection reset in the middle of a body ---------------------------------------


def _first_get_of_each_key_broken(action: Action, **action_for: Action) -> Rule:
    """Apply ``action`` to each object's first GET (``action_for[name]`` for the object of
    that base name, with '.' spelled '_')."""
    seen: set[str] = set()
    lock = threading.Lock()

    def rule(request: Request) -> Action:
        if request.operation != "GetObject" or request.header("Range"):
            return Forward()
        with lock:
            first = request.path not in seen
            seen.add(request.path)
        name = request.path.rsplit("/", 1)[-1].replace(".", "_")
        return action_for.get(name, action) if first else Forward()

    return rule


def test_reads_resume_after_a_reset_mid_body(moto_s3: EmbeddedS3, proxy: S3Proxy) -> None:
    """Every object's first answer breaks: manifests and shards (single-part and multipart)
    still read whole, each resumed by a ranged GET on the same ETag from the byte the reader
    reached (after a reset, the client's kernel discarded what had not been read)."""
    server = proxy.through(moto_s3)
    store = _open(server, _prefix("resume"))
    shards = {"model/rank0.bin": _data(5 * MiB // 2, 1), "small.json": _data(150, 2)}
    store.save(1, shards)
    reader = ckptstore.open(server.url(store.url.split("/", 3)[3]), **server.options)
    closed_early = Truncate(3 * MiB // 2, reset=False)
    short = Truncate(100, reset=False)  # a reset could drop the 100 bytes, or come too late
    proxy.rule = _first_get_of_each_key_broken(short, rank0_bin=closed_early)
    latest = reader.latest()
    assert latest is not None
    assert latest.step == 1
    for name, data in shards.items():
        assert latest.read(name) == data
    resumed = sorted((r.path.rsplit("/", 1)[-1], r.header("Range"), bool(r.header("If-Match")))
                     for r in proxy.requests if r.header("Range"))  # fmt: skip
    assert resumed == [("rank0.bin", f"bytes={3 * MiB // 2}-", True),
                       ("small.json", "bytes=100-", True),
                       ("step-00000000000000000001.json", "bytes=100-", True)]  # fmt: skip


def test_get_of_a_whole_object_survives_a_reset_mid_body(
    moto_s3: EmbeddedS3, proxy: S3Proxy
) -> None:
    server = proxy.through(moto_s3)
    driver = _driver(_open(server, _prefix("get")))
    driver.put("blob", _data(50 * KiB, 3))
    proxy.rule = _first_get_of_each_key_broken(Truncate(1000, reset=False))
    data, info = driver.get("blob")
    assert data == _data(50 * KiB, 3)
    assert info.size == len(data)


def test_a_resumed_read_never_splices_a_replaced_object(
    moto_s3: EmbeddedS3, proxy: S3Proxy
) -> None:
    """The object is replaced between the broken answer and the resume: the stream refuses
    (the bytes it was reading are gone); a whole-object get() reads the new object whole."""
    server = proxy.through(moto_s3)
    store = _open(server, _prefix("splice"))
    driver = _driver(store)
    old, new = _data(20 * KiB, 4), _data(20 * KiB, 5)
    driver.put("blob", old)
    direct = moto_s3.client()
    full_key = f"{driver.prefix}blob"
    breaks = [_first_get_of_each_key_broken(Truncate(5000))]

    def replace_before_resume(request: Request) -> Action:
        if request.header("Range"):
            direct.put_object(Bucket=moto_s3.bucket, Key=full_key, Body=new)
        return breaks[0](request)

    proxy.rule = replace_before_resume
    with (
        pytest.raises(ObjectNotFoundError, match="replaced or deleted while being read"),
        driver.open_read("blob") as stream,
    ):
        stream.read()
    direct.put_object(Bucket=moto_s3.bucket, Key=full_key, Body=old)
    breaks[0] = _first_get_of_each_key_broken(Truncate(5000))  # "blob" breaks once more
    assert driver.get("blob")[0] == new  # replaced again before the resume: read whole
    assert sum(r.operation == "GetObject" and not r.header("Range") for r in proxy.requests) == 3


def test_a_body_that_always_breaks_fails_after_bounded_resumes(
    moto_s3: EmbeddedS3, proxy: S3Proxy
) -> None:
    server = proxy.through(moto_s3)
    driver = _driver(_open(server, _prefix("bounded"), max_attempts=3))
    driver.put("blob", _data(10 * KiB, 6))
    proxy.rule = lambda r: Truncate(10) if r.operation == "GetObject" else Forward()
    with (
        pytest.raises(TransientStorageError, match="connection broke"),
        driver.open_read("blob") as stream,
    ):
        stream.read()
    gets = [r for r in proxy.requests if r.operation == "GetObject"]
    assert len(gets) == 3  # the first answer and two resumes


# -- item 10: every transport error is a ckptstore error ---------------------------------------


@pytest.mark.parametrize(
    ("operation", "action"),
    [
        # get() read the body through the raw urllib3 stream: a body cut short (the LATEST
        # hint's, read after publishing) raised urllib3's ProtocolError raw out of save()
        ("GetObject", Truncate(1, reset=False)),
        ("GetObject", Truncate(1)),
        ("CreateMultipartUpload", Truncate(40)),
        ("CompleteMultipartUpload", Truncate(40, reset=False)),
        ("UploadPart", Reset(after_upstream=True)),
        ("PutObject", Reset(after_upstream=True)),
        ("PutObject", Reset()),
        ("UploadPart", slow_down()),
    ],
    ids=_describe,
)
def test_a_save_survives_broken_answers(
    moto_s3: EmbeddedS3, proxy: S3Proxy, operation: str, action: Action
) -> None:
    """The first two answers to one kind of request break during a save: the save succeeds
    and only ckptstore errors were ever raised inside (translated, retried, resolved)."""
    server = proxy.through(moto_s3)
    store = _open(server, _prefix("broken"))
    store.save(1, {"small.bin": b"first"})  # a LATEST hint to read back after the next save
    shards = {"big.bin": _data(5 * MiB // 2, 7), "small.bin": b"tiny"}
    proxy.rule = once(lambda r: r.operation == operation, action, times=2)
    store.save(2, shards)
    proxy.rule = lambda r: Forward()
    latest = store.latest()
    assert latest is not None
    assert latest.step == 2
    assert {name: latest.read(name) for name in shards} == shards
    broken = [r for r in proxy.requests if r.operation == operation]
    assert len(broken) > 2  # two broken, and the ones that went through


def test_only_ckptstore_errors_escape_a_flaky_network(moto_s3: EmbeddedS3, proxy: S3Proxy) -> None:
    """A quarter of all requests fail in every way the proxy knows; saves and resumes
    succeed (retries, resumed bodies, conditional writes resolved by reading back)."""
    server = proxy.through(moto_s3)
    store = _open(server, _prefix("flaky"), max_attempts=10)
    chance = random.Random(11)
    lock = threading.Lock()
    faults: list[Action] = [slow_down(), Reset(), Reset(after_upstream=True), Truncate(30),
                            Truncate(3000, reset=False), Delay(0.05)]  # fmt: skip

    def flaky(request: Request) -> Action:
        with lock:
            return chance.choice(faults) if chance.random() < 0.25 else Forward()

    proxy.rule = flaky
    expected = {}
    for step in range(1, 5):
        expected = {"model/rank0.bin": _data(300 * KiB, step), "meta.json": b'{"s": %d}' % step}
        _save_streamed(store, step, expected)
        latest = store.latest()
        assert latest is not None
        assert latest.step == step
        assert {name: latest.read(name) for name in expected} == expected
    assert {"UploadPart", "CompleteMultipartUpload"} <= {r.operation for r in proxy.requests}


# -- item 11 (driver part): a conditional create resolves its own unknown outcomes ------------


_CREATE_FAULTS = [slow_down(), Reset(), Reset(after_upstream=True)]


def _conditional_put(request: Request) -> bool:
    return request.operation == "PutObject" and request.header("If-None-Match") == "*"


@pytest.mark.parametrize("action", _CREATE_FAULTS, ids=_describe)
def test_a_conditional_create_resolves_a_broken_answer(
    moto_s3: EmbeddedS3, proxy: S3Proxy, action: Action
) -> None:
    """Whether or not the broken put took effect, the caller gets the true outcome: created,
    or PreconditionFailedError when the key was there already."""
    server = proxy.through(moto_s3)
    driver = _driver(_open(server, _prefix("create")))
    proxy.rule = once(_conditional_put, action, times=2)  # botocore used to retry once
    info = driver.put("probe", b"1", mode=PutMode.CREATE)
    assert driver.get("probe")[0] == b"1"
    assert info.etag == driver.head("probe").etag
    proxy.rule = once(_conditional_put, action, times=2)  # botocore used to retry once
    with pytest.raises(PreconditionFailedError):
        driver.put("probe", b"2", mode=PutMode.CREATE)
    assert driver.get("probe")[0] == b"1"


def test_a_conditional_create_lost_to_another_writer_says_so(
    moto_s3: EmbeddedS3, proxy: S3Proxy
) -> None:
    server = proxy.through(moto_s3)
    driver = _driver(_open(server, _prefix("lost")))
    direct = moto_s3.client()

    def other_writer_first(request: Request) -> Action:
        direct.put_object(Bucket=moto_s3.bucket, Key=f"{driver.prefix}key", Body=b"theirs")
        return Reset()

    proxy.rule = lambda r: other_writer_first(r) if _conditional_put(r) else Forward()
    with pytest.raises(PreconditionFailedError, match="another writer created it first"):
        driver.put("key", b"ours", mode=PutMode.CREATE)


@pytest.mark.parametrize("action", _CREATE_FAULTS, ids=_describe)
def test_a_writer_opens_despite_faults_in_its_probe(
    moto_s3: EmbeddedS3, proxy: S3Proxy, action: Action
) -> None:
    """Two broken answers in a row to the conditional-create probe's puts: the writer opens,
    saves, and leaves no probe object behind."""
    server = proxy.through(moto_s3)
    prefix = _prefix("probe")
    proxy.rule = once(_conditional_put, action, times=2)  # botocore used to retry once
    store = _open(server, prefix)
    store.save(1, {"w": b"x"})
    leftovers = moto_s3.client().list_objects_v2(Bucket=moto_s3.bucket, Prefix=f"{prefix}/")
    assert all(".ckptstore-probe-" not in o["Key"] for o in leftovers.get("Contents", []))


# -- item 19: a CompleteMultipartUpload answer without an ETag ----------------------------------


def test_a_completion_answered_without_an_etag_is_completed_by_a_head(
    moto_s3: EmbeddedS3, proxy: S3Proxy
) -> None:
    server = proxy.through(moto_s3)
    store = _open(server, _prefix("etag"))
    proxy.rule = lambda r: (
        Rewrite(blank_etag) if r.operation == "CompleteMultipartUpload" else Forward()
    )
    data = _data(5 * MiB // 2, 8)
    store.save(1, {"big.bin": data})
    latest = store.latest()
    assert latest is not None
    assert latest.read("big.bin") == data
    record = latest.shards["big.bin"]
    head = moto_s3.client().head_object(
        Bucket=moto_s3.bucket, Key=f"{_driver(store).prefix}{record.locator['key']}"
    )
    assert record.locator["etag"] == head["ETag"]
    parts = head["ETag"].strip('"').rpartition("-")[2]
    assert parts.isdigit() and int(parts) > 1  # a multipart upload, in the store's part size
    assert any(r.operation == "CompleteMultipartUpload" for r in proxy.requests)


# -- item 25: the connection pool holds the transfer concurrency -------------------------------


def test_concurrent_multipart_saves_fit_the_connection_pool(
    moto_s3: EmbeddedS3, proxy: S3Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """16 part uploads in flight and 8 threads saving at once: no connection is discarded."""
    server = proxy.through(moto_s3)
    url = server.url(_prefix("pool"), part_size=64 * KiB, concurrency=16)
    store = ckptstore.open(url, **server.options)
    # Slow answers, so that every thread's request is in flight at the same time.
    proxy.rule = lambda r: Delay(0.2) if r.method in ("PUT", "POST") else Forward()
    errors: list[BaseException] = []

    def save(step: int) -> None:
        try:
            _save_streamed(store, step, {"big.bin": _data(1 * MiB, step)})
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    with caplog.at_level(logging.WARNING, logger="urllib3"):
        threads = [threading.Thread(target=save, args=(step,)) for step in range(1, 9)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert store.steps() == list(range(1, 9))
    assert [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")] == []


# -- item 28: SeaweedFS declares the part size it enforces -------------------------------------


def test_seaweedfs_declares_the_minimum_part_it_enforces(seaweedfs_s3: EmbeddedS3) -> None:
    """SeaweedFS refuses parts under 5 MiB at completion: a smaller part size is refused
    before anything is written, and a save with the declared minimum completes."""
    server = seaweedfs_s3
    prefix = _prefix("weed")
    with pytest.raises(InvalidOptionError, match="minimum part size"):
        ckptstore.open(server.url(prefix, part_size=64 * KiB), **server.options)
    store = ckptstore.open(server.url(prefix, part_size=server.min_part_size), **server.options)
    data = _data(server.min_part_size + 100 * KiB, 9)
    store.save(1, {"big.bin": data})
    latest = store.latest()
    assert latest is not None
    assert latest.read("big.bin") == data
    key = f"{prefix}/{latest.shards['big.bin'].locator['key']}"
    head = server.client().head_object(Bucket=server.bucket, Key=key)
    assert head["ETag"].strip('"').endswith("-2")  # two parts, the first of the minimum size


def _transport_errors() -> list[BaseException]:
    reset = ConnectionResetError(104, "Connection reset by peer")
    return [
        urllib3.exceptions.ProtocolError("Connection broken", reset),
        urllib3.exceptions.ReadTimeoutError(None, "/k", "Read timed out."),  # type: ignore[arg-type]
        http.client.IncompleteRead(b"x", 10),
        http.client.RemoteDisconnected("Remote end closed connection"),
        reset,
        BrokenPipeError(32, "Broken pipe"),
        TimeoutError("timed out"),
        ResponseStreamingError(error=reset),
        IncompleteReadError(actual_bytes=1, expected_bytes=2),
        ConnectionClosedError(endpoint_url="http://127.0.0.1:1/b/k"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:1/b/k"),
    ]


@pytest.mark.parametrize(
    "raised", _transport_errors(), ids=lambda e: f"{type(e).__module__}.{type(e).__name__}"
)
def test_every_transport_error_is_translated(raised: BaseException) -> None:
    """Whatever botocore lets through, the driver boundary raises a retryable ckptstore error
    whose outcome is in doubt, naming the call and chaining the original."""
    expected = pytest.raises(IndeterminateOutcomeError, match="GetObject k: the connection broke")
    with expected as caught, translate_s3_errors("GetObject k", bucket="b"):
        raise raised
    assert caught.value.__cause__ is raised


@pytest.mark.parametrize(
    ("code", "status", "kind", "errno_", "http_status"),
    [
        ("NoSuchKey", 404, ObjectNotFoundError, errno.ENOENT, 404),
        ("PreconditionFailed", 412, PreconditionFailedError, None, 412),
        ("AccessDenied", 403, StorageAccessDeniedError, errno.EACCES, 403),
        ("SlowDown", 503, TransientStorageError, None, 503),
        ("NotImplemented", 501, TransientStorageError, None, 501),
        ("InvalidArgument", 400, StorageError, None, 400),
    ],
)
def test_an_http_status_is_kept_apart_from_errno(
    code: str, status: int, kind: type, errno_: int | None, http_status: int
) -> None:
    answer = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    with pytest.raises(kind) as caught, translate_s3_errors("PutObject k", bucket="b"):
        raise ClientError(answer, "PutObject")  # type: ignore[arg-type]
    assert caught.value.errno == errno_  # a real errno or none: never an HTTP status
    assert caught.value.http_status == http_status
    assert f"PutObject k: {code}" in str(caught.value)
