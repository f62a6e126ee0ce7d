"""What a store holds is released: threads and connections at close (a thousand stores opened
and closed leave nothing behind), no secret kept as a cache key, and a file system's
renameat2 support known per file system, not per process."""

from __future__ import annotations

import ctypes
import errno
import gc
import itertools
import json
import os
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.backends import memory, s3_open
from ckptstore.backends.memory import drop_bucket
from ckptstore.backends.posix import PosixDriver

MiB = 1024 * 1024


def _threads(prefix: str) -> int:
    return sum(thread.name.startswith(prefix) for thread in threading.enumerate())


@pytest.fixture
def memory_url() -> Any:
    bucket = f"lifetimes-{os.getpid()}"
    yield f"memory://{bucket}/run?min_part_size=65536&part_size=65536&concurrency=4"
    drop_bucket(bucket)


def _save_streamed(store: ckptstore.Store, step: int) -> None:
    with store.begin(step) as pending, pending.open_shard("big") as shard:
        for _ in range(8):
            shard.write(bytes(range(256)) * 256)  # one part each


def test_a_store_used_as_a_context_manager_stops_its_upload_threads(memory_url: str) -> None:
    before = _threads("ckptstore-parts")
    with ckptstore.open(memory_url) as store:
        _save_streamed(store, 1)
        assert _threads("ckptstore-parts") > before  # the parts went up concurrently
    assert _threads("ckptstore-parts") == before
    _save_streamed(store, 2)  # a closed store may be used again
    assert store.latest().step == 2
    assert store.latest().read("big") == bytes(range(256)) * 2048
    store.close()
    store.close()  # closing twice is harmless
    assert _threads("ckptstore-parts") == before


def test_a_pipelined_read_leaves_no_thread_behind(tmp_path: Any) -> None:
    store = ckptstore.open(f"file://{tmp_path}/store")
    data = np.random.default_rng(0).integers(0, 255, 129 * MiB, dtype=np.uint8).tobytes()
    store.save(1, {"big": data})
    buffer = bytearray(len(data))
    store.latest().read_into("big", buffer)  # read and checksummed piece by piece
    assert buffer == data
    assert _threads("ckptstore-crc") == 0  # neither the save's nor the read's checksummers
    assert _threads("ckptstore-read") == 0


def test_no_credential_is_kept_as_a_cache_key() -> None:
    secret = "s3cr3t-kept-out-of-memory-keys"
    options = {
        "endpoint_url": "http://127.0.0.1:9",
        "region": "us-east-1",
        "aws_access_key_id": "AKIDLIFETIMES",
        "aws_secret_access_key": secret,
    }
    client = s3_open.make_client(options)
    assert s3_open.make_client(dict(options)) is client  # still shared by equal options
    assert s3_open.make_client({**options, "aws_secret_access_key": "other"}) is not client
    keys = repr(list(s3_open._clients))
    assert secret not in keys and "AKIDLIFETIMES" not in keys


class _NoRenameat2Here:
    """renameat2 as a kernel gives it, refused (EINVAL) on one file system only."""

    def __init__(self, refusing_root: str) -> None:
        self.refusing_root = refusing_root
        self.calls: list[str] = []

    def __call__(self, _fd: int, source: bytes, _fd2: int, target: bytes, _flags: int) -> int:
        self.calls.append(os.fsdecode(source))
        if os.fsdecode(source).startswith(self.refusing_root):
            ctypes.set_errno(errno.EINVAL)
            return -1
        os.rename(source, target)
        return 0


def test_renameat2_support_is_known_per_file_system(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing, working = tmp_path / "refusing", tmp_path / "working"
    fake = _NoRenameat2Here(str(refusing))
    monkeypatch.setattr(PosixDriver, "_renameat2", fake)
    monkeypatch.setattr(PosixDriver, "_renameat2_works", {})
    devices = {str(refusing): -101, str(working): -102}  # as if two file systems
    monkeypatch.setattr(PosixDriver, "_device", lambda self: devices[self.root])
    for root in (refusing, working):
        driver = PosixDriver(str(root))
        driver.ensure_root(create=True)
        for name in ("a", "b"):
            driver.mkdir(name)
            driver.rename_noreplace(name, f"{name}-renamed")  # the fallback where refused
        assert driver.listdir("") == ["a-renamed", "b-renamed"]
    assert PosixDriver._renameat2_works == {-101: False, -102: True}
    tried = [call.rsplit("/", 1)[-1] for call in fake.calls]
    assert tried == ["a", "a", "b"]  # refused once there, then not tried; tried here


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _held(prefix: str = "ckptstore") -> tuple[int, int]:
    """Threads of ckptstore's, and open file descriptors (sockets among them)."""
    gc.collect()
    return _threads(prefix), _open_fds()


def _no_more_than(before: tuple[int, int]) -> None:
    """Nothing more held than ``before`` (less is fine: idle connections that stores of an
    earlier test left in a shared client are closed when the last store using it closes)."""
    threads, fds = _held()
    assert threads <= before[0] and fds <= before[1], ((threads, fds), before)


def _open_and_close_stores(
    url: str, options: dict[str, Any], count: int, save_every: int, steps: Iterator[int]
) -> None:
    for number in range(count):
        store = ckptstore.open(url, **options)
        try:
            if number % save_every == 0:
                _save_streamed(store, next(steps))  # upload threads, connections
            else:
                assert store.latest() is not None  # a read: a connection
        finally:
            store.close()


@pytest.mark.parametrize(
    ("kind", "count"),
    [
        ("file", 1000),
        ("memory", 1000),
        pytest.param("s3", 100, marks=pytest.mark.slow),
        pytest.param("gs", 100, marks=pytest.mark.slow),  # keeps connections alive
    ],
)
def test_opening_and_closing_stores_holds_nothing_more(
    kind: str, count: int, tmp_path: Any, memory_url: str, request: pytest.FixtureRequest
) -> None:
    """Stores opened and closed one after another leave no thread, no socket or file, and
    no memory behind: what a store's driver holds (a shared client's connections, reader
    threads) is released by Store.close.

    Measured in a fresh interpreter: a thread that an earlier test in this worker left
    running (a server's, a background replicator's) allocates while the stores are counted,
    which is noise here, not a store's."""
    options: dict[str, Any] = {}
    if kind == "file":
        url = f"file://{tmp_path}/store"
    elif kind == "memory":
        url = memory_url
    elif kind == "gs":
        url = request.getfixturevalue("fake_gcs").url(f"lifetimes-{os.getpid()}", concurrency=4)
    else:
        server = request.getfixturevalue("moto_s3")
        url = server.url(f"lifetimes-{os.getpid()}", concurrency=4, part_size=server.min_part_size)
        options = {"aws_access_key_id": "x", "aws_secret_access_key": "y"}
    code = (
        "import json, sys; import test_lifetimes as t; "
        "print(t.measure_stores(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))"
    )
    measured = subprocess.run(
        [sys.executable, "-c", code, url, json.dumps(options), str(count)],
        capture_output=True,
        text=True,
        check=False,
        cwd=os.path.dirname(__file__),
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(
                    None,
                    [
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        os.environ.get("PYTHONPATH"),
                    ],
                )
            ),
        },
        timeout=600,
    )
    assert measured.returncode == 0, measured.stderr
    grown = int(measured.stdout.split()[-1])
    # An SDK's client-side caches (botocore's, the GCS client's) may keep tens of bytes per
    # request made; a store's own resources would be kilobytes each.
    per_store = 64 if kind in ("file", "memory") else 256
    assert grown < per_store * count, f"{grown} bytes more after {count} stores"


def measure_stores(url: str, options: dict[str, Any], count: int) -> int:
    """Bytes still allocated after ``count`` stores at ``url`` were opened, used and closed
    (after a warm-up); AssertionError if a thread or file descriptor was left behind."""
    steps = itertools.count(1)
    held = _held()
    _open_and_close_stores(url, options, 10, 5, steps)  # caches filled, first-use work done
    _no_more_than(held)  # a client outlives its stores, its connections do not
    tracemalloc.start()
    try:
        _open_and_close_stores(url, options, 10, 5, steps)
        before = tracemalloc.get_traced_memory()[0] - _bytes_in_memory_buckets()
        _open_and_close_stores(url, options, count, 50, steps)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - _bytes_in_memory_buckets() - before
    finally:
        tracemalloc.stop()
    _no_more_than(held)
    return grown


def _bytes_in_memory_buckets() -> int:
    """The checkpoints' bytes that memory:// buckets hold: data, not a leak."""
    with memory._BUCKETS_LOCK:
        buckets = list(memory._BUCKETS.values())
    return sum(len(v.data) for b in buckets for vs in b.objects.values() for v in vs)
