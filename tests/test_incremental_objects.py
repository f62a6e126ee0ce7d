"""Incremental saves on object stores: blobs named by a strong digest, used under leases that
only compare-and-swap changes; GC dooms a lease only from a state in which no user was
published or alive (I10, docs/protocol.md §12.3). Against real servers on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import EmbeddedS3

import ckptstore
from ckptstore.backends.fsspec import UNSAFE_OPTION
from ckptstore.commit.blob_leases import (
    BLOBS,
    LIVE,
    BlobName,
    Lease,
    LeaseCorruptError,
    parse_blob_key,
)
from ckptstore.driver import PutMode
from ckptstore.errors import (
    InvalidOptionError,
    ManifestCorruptError,
    ShardMissingError,
    TransientStorageError,
)

MiB = 2**20
LATER = 7200.0


@pytest.fixture(params=["s3", "gcs", "azure"])
def object_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A fresh prefix on each object store that does compare-and-swap."""
    fixture = {"s3": "moto_s3", "gcs": "fake_gcs", "azure": "azurite"}[request.param]
    server = request.getfixturevalue(fixture)
    return server.url(f"incremental/{os.getpid()}-{tmp_path.name}"), dict(server.options)


@pytest.fixture
def s3_url(moto_s3: EmbeddedS3, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return moto_s3.url(f"incremental/{os.getpid()}-{tmp_path.name}"), dict(moto_s3.options)


def _open(where: tuple[str, dict[str, Any]], **extra: Any) -> ckptstore.Store:
    url, options = where
    return ckptstore.open(url, incremental=True, **options, **extra)


def _later(where: tuple[str, dict[str, Any]], seconds: float = LATER) -> ckptstore.Store:
    """The store as GC sees it ``seconds`` from now (its clock moved: leftovers aged)."""
    url, options = where
    return ckptstore.open(url, clock=lambda: time.time() + seconds, **options)


def _keys(store: ckptstore.Store, prefix: str = BLOBS) -> list[str]:
    return sorted(info.key for info in store.strategy.driver.list(prefix))


def _generations(store: ckptstore.Store) -> list[str]:
    return [k for k in _keys(store) if (p := parse_blob_key(k)) is not None and p[1] is not None]


def _lease(store: ckptstore.Store, key: str) -> Lease:
    lease_key = key.rsplit(".g", 1)[0] + ".lease"
    return Lease.decode(store.strategy.driver.get(lease_key)[0], lease_key)


def test_an_unchanged_shard_is_one_blob_that_every_reader_reads(
    object_url: tuple[str, dict[str, Any]],
) -> None:
    store = _open(object_url)
    base = os.urandom(5 * MiB + 17)
    adapters = [os.urandom(4096 + step) for step in range(3)]
    for step, adapter in enumerate(adapters, start=1):
        store.save(step, {"model/base.bin": base, "model/lora.bin": adapter})
    locators = [dict(store.get(s).manifest.shard("model/base.bin").locator) for s in (1, 2, 3)]
    assert locators[0] == locators[1] == locators[2]
    assert locators[0]["blob"].startswith(("blake3:", "sha256:"))
    assert locators[0]["blob"].endswith(f"-{len(base)}")
    assert locators[0]["key"].endswith(f".g{locators[0]['generation']}")
    assert len(_generations(store)) == 4  # the base once, three adapters
    lease = _lease(store, locators[0]["key"])
    assert [user.step for user in lease.users] == [1, 2, 3] and not lease.doomed
    url, options = object_url
    reader = ckptstore.open(url, create=False, **options)  # a reader not incremental
    for step, adapter in enumerate(adapters, start=1):
        checkpoint = reader.get(step)
        assert checkpoint.read("model/base.bin") == base
        assert checkpoint.read("model/lora.bin") == adapter
        assert checkpoint.verify().ok
        assert not checkpoint.manifest.shard("model/base.bin").digest  # recorded by none


def test_gc_frees_a_blob_only_when_no_checkpoint_uses_it(
    s3_url: tuple[str, dict[str, Any]],
) -> None:
    store = _open(s3_url)
    base = os.urandom(3 * MiB)
    for step in (1, 2, 3):
        store.save(step, {"base": base, "lora": bytes([step]) * 1000})
    base_key = store.get(1).manifest.shard("base").locator["key"]
    loras = [store.get(s).manifest.shard("lora").locator["key"] for s in (1, 2)]
    store.delete(1)
    store.delete(2)
    before = _keys(store)
    dry = _later(s3_url).gc(grace=60, dry_run=True)
    assert {item.name for item in dry.removed if item.kind == "blob"} == set(loras)
    assert _keys(store) == before  # a dry run changes nothing
    report = _later(s3_url).gc(grace=60)
    removed = {item.name for item in report.removed}
    assert base_key not in removed
    assert len([i for i in report.removed if i.kind == "blob"]) == 2  # steps 1 and 2's lora
    assert store.get(3).read("base") == base and store.get(3).verify().ok
    assert [u.step for u in _lease(store, base_key).users] == [3]  # the dead users dropped
    store.delete(3, force=True)
    report = _later(s3_url).gc(grace=60)
    assert base_key in {item.name for item in report.removed}
    assert _generations(store) == []
    assert _lease(store, base_key).doomed
    assert _keys(store, LIVE) == []  # no marker outlives its attempt
    store.save(4, {"base": base})  # a doomed blob's next writer reserves a new generation
    locator = store.get(4).manifest.shard("base").locator
    assert locator["key"] != base_key and store.get(4).read("base") == base
    assert _lease(store, locator["key"]).generation == locator["generation"]
    store.delete(4, force=True)
    _later(s3_url).gc(grace=60)  # dooms it again
    report = _later(s3_url, 2 * LATER).gc(grace=60)  # and, doomed for long, removes its lease
    assert [item.kind for item in report.removed] == ["blob lease"], report.removed
    assert not [key for key in _keys(store) if key.endswith(".lease")]
    store.save(5, {"base": base})  # a fresh lease, a fresh generation: never one used before
    assert store.get(5).read("base") == base and store.get(5).verify().ok


def test_a_writer_gc_judged_dead_publishes_nothing(s3_url: tuple[str, dict[str, Any]]) -> None:
    """GC that dooms a blob while a stalled writer holds it: the writer's seal reads the
    lease and refuses; the published checkpoint that also used it is never touched."""
    store = _open(s3_url)
    base = os.urandom(MiB)
    store.save(1, {"base": base})
    stalled = _open(s3_url)
    pending = stalled.begin(2)
    pending.write("base", base)  # appended to the lease
    store.delete(1, force=True)
    report = _later(s3_url).gc(grace=60)  # the stalled writer is idle "two hours"
    assert any(item.kind == "blob" for item in report.removed)
    with pytest.raises(ShardMissingError, match=r"doomed|dropped|missing"):
        pending.publish()
    assert stalled.latest() is None
    store.save(3, {"base": base})  # and a fresh save writes the blob again
    assert store.get(3).read("base") == base


def test_gc_does_not_doom_a_blob_a_live_writer_appended_to(
    s3_url: tuple[str, dict[str, Any]],
) -> None:
    store = _open(s3_url)
    base = os.urandom(MiB)
    store.save(1, {"base": base})
    pending = _open(s3_url).begin(2)
    pending.write("base", base)
    store.delete(1, force=True)
    report = store.gc(grace=3600)  # the writer is alive: its marker is fresh
    assert not [item for item in report.removed if item.kind == "blob"]
    pending.publish()
    assert store.get(2).read("base") == base and store.get(2).verify().ok


def test_gc_racing_the_append_either_keeps_the_blob_or_the_writer_reserves_anew(
    s3_url: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC reads the lease (no live user), a writer appends itself before GC's doom: the doom
    CAS fails on the changed ETag, GC judges again and keeps the blob."""
    store = _open(s3_url)
    base = os.urandom(MiB)
    store.save(1, {"base": base})
    store.delete(1, force=True)
    writer = _open(s3_url)
    gc_store = _later(s3_url, 600)
    driver = gc_store.strategy.driver
    real_put = driver.put
    raced: list[int] = []

    def put(key: str, data: Any, **kwargs: Any) -> Any:
        if key.endswith(".lease") and not raced:  # GC's doom, about to be sent
            raced.append(1)
            pending = writer.begin(2)
            pending.write("base", base)
            pending.publish()
        return real_put(key, data, **kwargs)

    monkeypatch.setattr(driver, "put", put)
    gc_store.gc(grace=60)
    assert raced
    assert store.get(2).read("base") == base and store.get(2).verify().ok
    assert not _lease(store, store.get(2).manifest.shard("base").locator["key"]).doomed


def test_an_unknown_outcome_of_the_append_is_read_back(
    s3_url: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(s3_url)
    base = os.urandom(MiB)
    store.save(1, {"base": base})
    driver = store.strategy.driver
    real_put = driver.put
    lost: list[str] = []

    def put(key: str, data: Any, **kwargs: Any) -> Any:
        answer = real_put(key, data, **kwargs)
        if key.endswith(".lease") and not lost:  # it took effect; the answer is lost
            lost.append(key)
            raise TransientStorageError("connection reset after the request was sent")
        return answer

    monkeypatch.setattr(driver, "put", put)
    store.save(2, {"base": base})
    assert lost
    lease = _lease(store, store.get(2).manifest.shard("base").locator["key"])
    assert [user.step for user in lease.users] == [1, 2]  # appended once, not twice


def test_a_corrupt_lease_is_neither_shared_nor_collected(
    s3_url: tuple[str, dict[str, Any]],
) -> None:
    store = _open(s3_url)
    base = os.urandom(MiB)
    store.save(1, {"base": base})
    key = store.get(1).manifest.shard("base").locator["key"]
    lease_key = key.rsplit(".g", 1)[0] + ".lease"
    store.strategy.driver.put(lease_key, b'{"format": "something else"}')
    store.save(2, {"base": base})  # written unshared, under its attempt
    locator = store.get(2).manifest.shard("base").locator
    assert "blob" not in locator and store.get(2).read("base") == base
    store.delete(1)
    report = _later(s3_url).gc(grace=60)
    assert any("not a blob lease" in warning for warning in report.warnings)
    assert key in _keys(store)  # left for an operator


def test_a_reserver_that_died_before_its_upload_costs_no_wait(
    s3_url: tuple[str, dict[str, Any]],
) -> None:
    """A lease whose reserver's marker is long stale and whose bytes never came: the next
    writer appends itself, sees the reserver gone, and writes its shard unshared at once."""
    store = _open(s3_url)
    base = os.urandom(MiB)
    from ckptstore.digest import default_algorithm
    from ckptstore.pending import shard_checksums

    _, digests = shard_checksums(memoryview(base), default_algorithm())
    assert digests is not None
    digests.finish()
    blob = BlobName(digests.algorithm, digests.hexdigest(), len(base))
    from ckptstore.commit.blob_leases import User

    ghost = User(7, "ghost0000000000000000")
    driver = store.strategy.driver
    lease = Lease("generation00000001", False, (ghost,), ghost)
    driver.put(blob.lease_key, lease.encode(), mode=PutMode.CREATE)
    started = time.monotonic()
    store.save(1, {"base": base})
    assert time.monotonic() - started < 30
    assert "blob" not in store.get(1).manifest.shard("base").locator
    assert store.get(1).read("base") == base


@pytest.mark.parametrize(
    "change",
    [
        lambda loc, size: {**loc, "key": "step-00000000000000000009.other/base"},
        lambda loc, size: {**loc, "blob": loc["blob"].replace(f"-{size}", f"-{size + 1}")},
        lambda loc, size: {**loc, "generation": "0"},
        lambda loc, size: {**loc, "blob": "md5:abc-1"},
    ],
)
def test_a_tampered_blob_locator_is_refused(
    s3_url: tuple[str, dict[str, Any]], change: Callable[[dict[str, str], int], dict[str, str]]
) -> None:
    store = _open(s3_url)
    store.save(1, {"base": b"x" * 5000})
    manifest = store.get(1).manifest
    record = manifest.shards[0]
    forged = dataclasses.replace(
        manifest,
        shards=(dataclasses.replace(record, locator=change(dict(record.locator), 5000)),),
    )
    store.strategy.driver.put(store.strategy.manifest_key(1), forged.encode())
    with pytest.raises(ManifestCorruptError):
        store.get(1)


def test_stores_that_cannot_lease_refuse_incremental(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="compare-and-swap"):
        ckptstore.open(f"fsspec+file://{tmp_path}/fs?{UNSAFE_OPTION}=true", incremental=True)


@pytest.fixture(params=["memory+versioned", "s3+versioned"])
def versioned_url(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, dict[str, Any]]:  # a versioned bucket: manifests pin versions
    if request.param == "memory+versioned":
        return f"memory+versioned://incremental-{tmp_path.name}/run", {}
    server = request.getfixturevalue("moto_s3").versioned_bucket("incremental-versioned")
    return server.url(f"v/{tmp_path.name}", scheme=request.param), dict(server.options)


def _all_versions(store: ckptstore.Store, prefix: str) -> list[Any]:
    return list(store.strategy.driver.list_versions(prefix))


def test_a_versioned_store_shares_blobs_and_gc_frees_every_version(
    versioned_url: tuple[str, dict[str, Any]],
) -> None:
    """On a versioned bucket (§12.3, versioned stores) a shared shard pins its blob
    generation's version; deleting a checkpoint never deletes a shared blob's version; GC
    frees a blob only once no checkpoint uses it, and then every version of it, its lease's
    and its markers' included (a plain DELETE would only hide them)."""
    store = _open(versioned_url)
    base = os.urandom(300_000)
    for step in range(1, 5):
        store.save(step, {"base": base, "adapter": os.urandom(1000)})
    records = {s: {r.name: r for r in store.get(s).manifest.shards} for s in range(1, 5)}
    locators = {records[s]["base"].locator["key"] for s in range(1, 5)}
    assert len(locators) == 1  # one generation, shared by all four
    assert all(records[s]["base"].locator.get("version_id") for s in range(1, 5))
    for step in (1, 2, 3):
        store.delete(step)  # each unpublish deletes its own pinned versions, not the blob's
    assert store.get(4).read("base") == base and store.get(4).verify().ok
    reader = ckptstore.open(versioned_url[0], **versioned_url[1])  # not incremental
    assert reader.get(4).read("base") == base
    _later(versioned_url).gc(grace=60)
    assert store.get(4).read("base") == base and store.get(4).verify().ok
    _later(versioned_url).gc(grace=60)  # the leases' older versions, written by the last GC
    leases = {v.key for v in _all_versions(store, BLOBS) if v.key.endswith(".lease")}
    for lease in leases:  # one version each: the CASes' older ones are swept
        assert len([v for v in _all_versions(store, lease) if v.key == lease]) == 1
    store.delete(4, force=True)
    for hours in (2, 4, 8):  # doomed, deleted; retired after the grace period, deleted
        _later(versioned_url, hours * 3600.0).gc(grace=60)
    assert _all_versions(store, BLOBS) == []


WRITER = textwrap.dedent(
    """
    import json, sys
    import ckptstore
    url, options, first = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    store = ckptstore.open(url, incremental=True, retention=ckptstore.KeepLast(2), **options)
    base = bytes(range(256)) * 8192  # 2 MiB, never changes
    step = first
    while True:
        store.save(step, {"base": base, "adapter": bytes([step % 251]) * 300_000})
        print(f"published {step}", flush=True)
        step += 1
    """
)

GC = textwrap.dedent(
    """
    import json, sys, time
    import ckptstore
    url, options = sys.argv[1], json.loads(sys.argv[2])
    store = ckptstore.open(url, clock=lambda: time.time() + 7200, **options)
    driver = store.strategy.driver
    delete = driver.delete

    def deleted(key, **kwargs):
        delete(key, **kwargs)
        print("deleted", key, flush=True)

    driver.delete = deleted
    store.gc(grace=60)
    print("done", flush=True)
    """
)


def test_sigkill_of_incremental_writers_and_of_gc_loses_no_shared_blob(
    s3_url: tuple[str, dict[str, Any]],
) -> None:
    url, options = s3_url
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    base = bytes(range(256)) * 8192
    rng = random.Random(28)
    step = 0
    for trial in range(6):
        command = [sys.executable, "-c", WRITER, url, json.dumps(options), str(step + 1)]
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as writer:
            assert writer.stdout is not None
            for _ in range(rng.randint(1, 3)):  # saves to wait for, then a kill: mid-save
                line = writer.stdout.readline()
                assert line.startswith("published"), line
                step = int(line.split()[1])
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()
        if trial % 2:  # a GC, its clock two hours on, killed after its first delete
            command = [sys.executable, "-c", GC, url, json.dumps(options)]
            with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as gc:
                assert gc.stdout is not None
                if gc.stdout.readline().startswith("deleted"):
                    os.kill(gc.pid, signal.SIGKILL)
                gc.wait()
        store = ckptstore.open(url, **options)
        latest = store.latest()
        assert latest is not None and latest.step >= step
        for checkpoint in store.checkpoints():
            assert checkpoint.read("base") == base
            assert checkpoint.read("adapter") == bytes([checkpoint.step % 251]) * 300_000
            assert checkpoint.verify().ok
        step = latest.step
    _later(s3_url).gc(grace=60)
    store = ckptstore.open(url, **options)
    assert all(c.verify().ok for c in store.checkpoints())
    used = {r.locator["key"] for c in store.checkpoints() for r in c.manifest.shards}
    assert set(_generations(store)) == {k for k in used if k.startswith(BLOBS)}


def test_the_operator_sees_what_is_shared_on_an_object_store(tmp_path: Path) -> None:
    """``ls``/``show`` count a blob once, ``verify --all`` reads it once, ``gc --dry-run``
    says why each blob goes."""
    import io

    from ckptstore.cli import main

    url = f"memory://operator-{os.getpid()}-{tmp_path.name}/run"
    store = ckptstore.open(url, incremental=True)
    base = os.urandom(2 * MiB)
    for step in (1, 2, 3):
        store.save(step, {"base": base, "adapter": os.urandom(1000)})

    def run(*argv: str) -> str:
        out = io.StringIO()
        assert main([*argv], out) == 0, out.getvalue()
        return out.getvalue()

    listing = run("ls", url)
    assert "SHARED" in listing and listing.count("2.0 MiB  ok") == 3, listing
    assert "stored: 2.0 MiB for checkpoints of 6.0 MiB in all" in listing, listing
    assert "2.0 MiB of it shared with other checkpoints" in run("show", url, "2")
    verified = run("verify", url, "--all")
    assert "1 shard(s) shared with one checked above" in verified, verified
    store.delete(1)
    store.delete(2)
    time.sleep(0.01)  # the deleted checkpoints' liveness markers older than no grace
    dry = run("gc", url, "--grace", "0", "--dry-run")
    assert "would remove blob blobs/" in dry and "its lease is doomed" in dry, dry
    assert "would remove liveness marker" in dry, dry
    assert store.get(3).read("base") == base
    run("gc", url, "--grace", "0")
    assert store.get(3).read("base") == base and store.get(3).verify().ok


def _memory(tmp_path: Path, **options: Any) -> tuple[str, dict[str, Any]]:
    return f"memory://inc-{os.getpid()}-{tmp_path.name}/run", options


def test_a_reserver_whose_upload_failed_holds_up_no_later_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its save fails; the next save of the same bytes neither waits for bytes that will
    never come nor names the blob, so GC dooms the lease and a later save shares again."""
    where = _memory(tmp_path)
    store = _open(where)
    base = os.urandom(256 * 1024)
    driver = store.strategy.driver
    real_put = driver.put

    def failing(key: str, data: Any, **kwargs: Any) -> Any:
        if ".g" in key.rpartition("/")[2]:
            raise OSError("the network went away")
        return real_put(key, data, **kwargs)

    monkeypatch.setattr(driver, "put", failing)
    with pytest.raises(Exception, match="network"):
        store.save(1, {"base": base})
    monkeypatch.setattr(driver, "put", real_put)
    started = time.monotonic()
    store.save(2, {"base": base})
    assert time.monotonic() - started < 10
    assert "blob" not in store.get(2).manifest.shard("base").locator  # written unshared
    lease_key = next(k for k in _keys(store) if k.endswith(".lease"))
    lease = Lease.decode(driver.get(lease_key)[0], lease_key)
    assert [user.step for user in lease.users] == [1]  # the unshared save never named it
    _later(where).gc(grace=60)
    store.save(3, {"base": base})
    store.save(4, {"base": base})
    locators = [store.get(s).manifest.shard("base").locator for s in (3, 4)]
    assert locators[0]["key"] == locators[1]["key"]
    assert locators[0]["generation"] != lease.generation  # the dead reserver's, doomed


def test_gc_keeps_a_blob_whose_reserver_is_still_uploading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload longer than the grace period, its parts still coming: GC judges its
    reserver alive by them, as it judges an attempt's own multipart uploads."""
    import threading

    where = _memory(tmp_path, part_size=4096, min_part_size=4096)
    url, _ = where
    store = ckptstore.open(f"{url}?part_size=4096&min_part_size=4096", incremental=True)
    driver = store.strategy.driver
    real_part = driver.upload_part

    GRACE = 2.0
    first_part: list[float] = []
    holding, collected = threading.Event(), threading.Event()

    def slow_part(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.04)
        answer = real_part(*args, **kwargs)
        first_part.append(time.monotonic())
        if time.monotonic() - first_part[0] > GRACE + 0.5 and not holding.is_set():
            holding.set()  # GC runs now, right after this part (a stall then is short)
            collected.wait(60)
        return answer

    monkeypatch.setattr(driver, "upload_part", slow_part)
    base = os.urandom(120 * 4096)  # 120 parts, 40 ms each
    failed: list[BaseException] = []

    def save() -> None:
        try:
            store.save(1, {"base": base})
        except BaseException as exc:
            failed.append(exc)

    saving = threading.Thread(target=save)
    saving.start()
    assert holding.wait(60), "the upload never ran past the grace period"
    try:  # its reservation is older than the grace period, its last part a moment old
        report = ckptstore.open(f"{url}?part_size=4096&min_part_size=4096").gc(grace=GRACE)
    finally:
        collected.set()
    saving.join()
    assert not failed, failed
    assert not [item for item in report.removed if item.kind.startswith("blob")], report.removed
    assert store.get(1).read("base") == base


@pytest.mark.parametrize(
    "planted",
    [b"[" * 200_000 + b"]" * 200_000, b"{}" + b" " * (2 * MiB), b"\xff\xfe"],
    ids=["deeply-nested", "too-large", "not-json"],
)
def test_a_planted_lease_is_refused_for_sharing_and_left_alone_by_gc(
    tmp_path: Path, planted: bytes
) -> None:
    where = _memory(tmp_path)
    store = _open(where)
    base = os.urandom(4096)
    store.save(1, {"base": base})
    key = store.get(1).manifest.shard("base").locator["key"]
    lease_key = key.rsplit(".g", 1)[0] + ".lease"
    store.strategy.driver.put(lease_key, planted)
    store.save(2, {"base": base})
    assert "blob" not in store.get(2).manifest.shard("base").locator
    report = _later(where).gc(grace=60)
    assert any("not a blob lease" in warning for warning in report.warnings), report.warnings
    assert key in _keys(store) and store.get(1).read("base") == base


def test_a_lease_changed_behind_a_save_fails_it_with_a_clear_error(tmp_path: Path) -> None:
    where = _memory(tmp_path)
    store = _open(where)
    base = os.urandom(4096)
    store.save(1, {"base": base})
    pending = store.begin(2)
    pending.write("base", base)
    key = store.get(1).manifest.shard("base").locator["key"]
    store.strategy.driver.put(key.rsplit(".g", 1)[0] + ".lease", b"garbage")
    with pytest.raises(ShardMissingError, match="leases do not vouch") as caught:
        pending.publish()
    assert "garbage collection" not in str(caught.value)


def test_the_seal_moves_the_lease_etag_so_an_earlier_gc_read_cannot_doom(
    tmp_path: Path,
) -> None:
    """Every change writes new bytes (the serial grows): the seal's confirmation fails the
    CAS of a GC that read the lease before it, even where an ETag is the content's MD5."""
    where = _memory(tmp_path)
    store = _open(where)
    base = os.urandom(4096)
    pending = store.begin(1)
    pending.write("base", base)
    driver = store.strategy.driver
    lease_key = next(k for k in _keys(store) if k.endswith(".lease"))
    before = driver.head(lease_key).etag
    serial = Lease.decode(driver.get(lease_key)[0], lease_key).serial
    pending.publish()
    assert driver.head(lease_key).etag != before
    assert Lease.decode(driver.get(lease_key)[0], lease_key).serial == serial + 1


def test_a_writer_reserving_in_a_lease_gc_is_retiring_keeps_its_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC reads a long-doomed lease; a writer reserves a new generation in it before GC's
    retiring CAS: the CAS fails, the lease stays, and the writer's checkpoint keeps its blob
    through every later save and GC (the lease was once deleted unconditionally here)."""
    where = _memory(tmp_path)
    store = _open(where)
    base = os.urandom(8192)
    store.save(1, {"base": base})
    store.delete(1, force=True)
    _later(where).gc(grace=60)  # dooms it
    gc_store = _later(where, 2 * LATER)
    driver = gc_store.strategy.driver
    real_put = driver.put
    raced: list[int] = []

    def put(key: str, data: Any, **kwargs: Any) -> Any:
        if key.endswith(".lease") and not raced:  # GC's retiring CAS, about to be sent
            raced.append(1)
            store.save(2, {"base": base})  # reserves a new generation in the doomed lease
        return real_put(key, data, **kwargs)

    monkeypatch.setattr(driver, "put", put)
    report = gc_store.gc(grace=60)
    assert raced and "blob lease" not in [item.kind for item in report.removed]
    monkeypatch.undo()
    store.save(3, {"base": base})
    for days in (3, 4):
        _later(where, days * LATER).gc(grace=60)
    for step in (2, 3):
        assert store.get(step).read("base") == base and store.get(step).verify().ok


def test_a_second_shard_of_the_same_bytes_uploads_what_a_failed_first_did_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = _memory(tmp_path)
    store = _open(where)
    driver = store.strategy.driver
    real_put = driver.put
    failed: list[str] = []

    def put(key: str, data: Any, **kwargs: Any) -> Any:
        if ".g" in key.rpartition("/")[2] and not failed:
            failed.append(key)
            raise OSError("the network went away")
        return real_put(key, data, **kwargs)

    monkeypatch.setattr(driver, "put", put)
    zeros = bytes(64 * 1024)  # two zero-initialised LoRA matrices: the same bytes
    pending = store.begin(1)
    with pytest.raises(Exception, match="network"):
        pending.write("lora_a.bin", zeros)
    started = time.monotonic()
    record = pending.write("lora_b.bin", zeros)
    assert time.monotonic() - started < 10 and "blob" in record.locator
    pending.abort()


def test_a_full_lease_and_a_replaced_generation_are_not_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptstore.commit import blob_leases

    where = _memory(tmp_path)
    store = _open(where)
    base = os.urandom(8192)
    monkeypatch.setattr(blob_leases, "MAX_USERS", 2)
    for step in (1, 2, 3):
        store.save(step, {"base": base})
    assert "blob" in store.get(2).manifest.shard("base").locator
    assert "blob" not in store.get(3).manifest.shard("base").locator  # the lease was full
    monkeypatch.setattr(blob_leases, "MAX_USERS", 4096)
    key = store.get(1).manifest.shard("base").locator["key"]
    lease = _lease(store, key)
    assert lease.etag == store.get(1).manifest.shard("base").locator["etag"]  # at the seal
    store.strategy.driver.put(key, os.urandom(8192))  # replaced: same size, other bytes
    store.save(4, {"base": base})
    assert "blob" not in store.get(4).manifest.shard("base").locator
    assert store.get(4).read("base") == base and store.get(4).verify().ok


def test_a_lease_gc_removed_under_a_save_is_said_to_be_gcs_doing(tmp_path: Path) -> None:
    where = _memory(tmp_path)
    store = _open(where)
    base = os.urandom(4096)
    pending = store.begin(1)
    pending.write("base", base)
    lease_key = next(k for k in _keys(store) if k.endswith(".lease"))
    store.strategy.driver.delete(lease_key)
    with pytest.raises(ShardMissingError, match=r"removed by garbage collection|GC") as caught:
        pending.publish()
    assert "do not vouch" not in str(caught.value)


@pytest.fixture(params=["memory", "memory+versioned"])
def memory_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return f"{request.param}://leases-{tmp_path.name}/run", {}


def _checkpoints_read_whole(where: tuple[str, dict[str, Any]]) -> list[int]:
    """The steps whose every shard reads back (a reader of its own, not incremental)."""
    store = ckptstore.open(where[0], **where[1])
    whole = []
    for checkpoint in store.checkpoints():
        for record in checkpoint.manifest.shards:
            checkpoint.read(record.name)
        whole.append(checkpoint.step)
    return whole


def test_a_lease_deleted_behind_the_store_costs_no_published_blob(
    memory_url: tuple[str, dict[str, Any]],
) -> None:
    """An operator deletes a lease by hand (on a versioned bucket a DELETE only hides it):
    later saves of the same bytes must not make GC delete the generation a published
    checkpoint still names (it is not of the new lease's lineage; a hidden lease is damaged,
    not absent)."""
    store = _open(memory_url)
    base = os.urandom(100_000)
    store.save(1, {"base": base})
    key = store.get(1).manifest.shard("base").locator["key"]
    store.strategy.driver.delete(key.rsplit(".g", 1)[0] + ".lease")
    store.save(2, {"base": base})
    store.delete(2, force=True)
    for hours in (2, 4, 8):
        _later(memory_url, hours * 3600.0).gc(grace=60)
    assert _checkpoints_read_whole(memory_url) == [1]
    assert store.get(1).read("base") == base


def test_two_gcs_removing_one_retired_lease_leave_a_new_lease_alone(
    memory_url: tuple[str, dict[str, Any]],
) -> None:
    """GC B reads a retired lease; GC C removes it; a writer creates the lease anew and
    publishes; then B goes on with its removal. The writer's checkpoint keeps its blob: B's
    claim (a CAS) fails against the new lease, or (B paused between its claim and its
    DELETE, on storage without versions) a later lease of the blob does not delete a
    generation of another lineage."""
    store = _open(memory_url)
    base = os.urandom(100_000)
    store.save(1, {"base": base})
    store.delete(1, force=True)
    _later(memory_url, 2 * 3600.0).gc(grace=60)  # doomed, its generation deleted
    crashed = _later(memory_url, 4 * 3600.0)
    crashed.strategy._blobs._delete = lambda *args: None  # type: ignore[attr-defined]
    crashed.gc(grace=60)  # retired, then died before removing it
    late, other = _later(memory_url, 6 * 3600.0), _later(memory_url, 6 * 3600.0)
    removing = late.strategy._blobs._delete  # type: ignore[attr-defined]

    def removed_meanwhile(key: str, etag: str | None = None) -> None:
        if key.endswith(".lease"):
            other.gc(grace=60)  # removes the retired lease
            store.save(2, {"base": base})  # no lease: a new one, published with it
        removing(key, etag)

    late.strategy._blobs._delete = removed_meanwhile  # type: ignore[attr-defined]
    late.gc(grace=60)
    assert store.get(2).read("base") == base
    store.save(3, {"base": base})
    store.delete(3, force=True)
    warnings = []
    for hours in (8, 10, 14):
        warnings += _later(memory_url, hours * 3600.0).gc(grace=60).warnings
    assert _checkpoints_read_whole(memory_url) == [2]
    store.delete(2, force=True)
    for hours in (16, 20):
        warnings += _later(memory_url, hours * 3600.0).gc(grace=60).warnings
    if memory_url[0].startswith("memory://"):  # the new lease went with the plain DELETE
        assert any("left alone" in warning for warning in warnings), warnings
    else:  # the DELETE named the claimed version: the new lease stayed, and is collected
        assert not warnings and _keys(store) == []


@pytest.mark.parametrize(
    "body",
    [
        {"version": 2, "lineage": "zzzzzzzz"},  # not hex
        {"version": 2, "lineage": "0badcafe"},  # its generation is not of it
        {"version": 2},  # a version-2 lease without one
        {"version": 1, "lineage": "0badcafe"},  # version 1 knows none
    ],
)
def test_a_lease_with_a_bad_lineage_is_damaged(body: dict[str, Any]) -> None:
    lease = {"format": "ckptstore-blob-lease", "generation": "mxbx0000aaaaaaaa", "doomed": False,
             "users": [], "serial": 1} | body  # fmt: skip
    with pytest.raises(LeaseCorruptError):
        Lease.decode(json.dumps(lease).encode(), "planted")


def test_a_new_lease_has_a_lineage_that_its_generations_carry() -> None:
    lease = Lease("", False, (), lineage="0badcafe")
    generation = lease.new_generation()
    assert generation.startswith("0badcafe") and lease.owns(generation)
    assert not lease.owns("mxbx0000aaaaaaaa")
    stored = Lease(generation, False, (), lineage="0badcafe", serial=3)
    assert Lease.decode(stored.encode(), "here") == stored
    assert Lease("mxbx0000aaaaaaaa", False, ()).owns("anything0000")  # before lineages


def test_gc_of_a_versioned_store_leaves_foreign_objects_under_blobs_alone(
    tmp_path: Path,
) -> None:
    url = f"memory+versioned://foreign-{tmp_path.name}/run"
    store = ckptstore.open(url)
    store.save(1, {"w": b"x" * 1000})
    driver = store.strategy.driver
    driver.put("blobs/notes.txt", b"v1")
    driver.put("blobs/notes.txt", b"v2")
    driver.put("blobs/live/other.txt", b"a")
    driver.delete("blobs/live/other.txt")  # a user's object under a delete marker
    before = sorted((v.key, v.version_id) for v in driver.list_versions("blobs/"))
    for _ in range(2):
        ckptstore.open(url, clock=lambda: time.time() + LATER).gc(grace=60)
    assert sorted((v.key, v.version_id) for v in driver.list_versions("blobs/")) == before
