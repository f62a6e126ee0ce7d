"""Strays, racing deletions, hostile manifests and hints cost no checkpoint (issue 11, 1-3, 6-8).

Each test runs on file://, memory:// and s3:// (the embedded moto server) through the
``backend`` fixture, unless it is about one family's layout.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import pytest
from conftest import BackendUnderTest, FileBackend, MemoryBackend, S3Backend

from ckptstore import KeepLast
from ckptstore.errors import (
    CheckpointNotFoundError,
    InvalidMetadataError,
    ManifestCorruptError,
    NotACheckpointError,
    ObjectNotFoundError,
    RefusedError,
    ShardCorruptError,
    ShardMissingError,
)
from ckptstore.manifest import MAX_METADATA_DEPTH, Manifest
from ckptstore.store import Store

ARABIC_INDIC_DIGITS = "".join(chr(0x0660 + (i % 10)) for i in range(20))


def _save(store: Store, step: int) -> None:
    store.save(step, {"w.bin": bytes([step % 251]) * 100})


def _put_raw(backend: BackendUnderTest, store: Store, key: str, body: bytes) -> None:
    """Write ``key`` under the store's prefix behind ckptstore's back, as an operator would."""
    if isinstance(backend, S3Backend):
        backend.client.put_object(
            Bucket=backend.server.bucket, Key=f"{backend.prefix}/{key}", Body=body
        )
    else:
        store.strategy.driver.put(key, body)  # type: ignore[attr-defined]


def _plant_strays(backend: BackendUnderTest, store: Store) -> list[str]:
    """Entries named like steps that no publish made; returns their raw names."""
    if isinstance(backend, FileBackend):
        root = backend.root
        os.mkdir(os.path.join(root, "step-99999999999999999999"))  # an operator's mkdir
        os.mkdir(os.path.join(root, f"step-{ARABIC_INDIC_DIGITS}"))
        os.mkdir(os.path.join(root, "step-00000000000000000050\n"))
        with open(os.path.join(root, "step-00000000000000000060"), "wb"):
            pass  # an empty file
        # an interrupted `cp -r` of a step directory: data, no manifest
        os.makedirs(os.path.join(root, "step-00000000000000000070", "data"))
        with open(os.path.join(root, "step-00000000000000000070", "data", "w.bin"), "wb") as f:
            f.write(b"x" * 100)
        return [
            "step-99999999999999999999",
            f"step-{ARABIC_INDIC_DIGITS}",
            "step-00000000000000000050\n",
            "step-00000000000000000060",
            "step-00000000000000000070",
        ]
    keys = [
        f"manifests/step-{ARABIC_INDIC_DIGITS}.json",
        "manifests/step-99999999999999999999.json.bak",
        "step-00000000000000000070.partial-copy/w.bin",
        "step-00000000000000000080/w.bin",
    ]
    if isinstance(backend, MemoryBackend):  # moto's HTTP routing refuses a key ending in '\n'
        keys.append("manifests/step-00000000000000000050.json\n")
    for key in keys:
        _put_raw(backend, store, key, b"" if key.startswith("manifests/") else b"x" * 100)
    return keys


def test_strays_are_not_checkpoints_and_are_never_deleted(backend: BackendUnderTest) -> None:
    store = backend.open(retention=KeepLast(1))
    _save(store, 1)
    strays = _plant_strays(backend, store)
    for step in (2, 3):
        _save(store, step)
        # KeepLast(1) must keep the checkpoint just published, whatever the strays
        assert store.steps() == [step]
        latest = store.latest()
        assert latest is not None and latest.step == step
        assert latest.read("w.bin") == bytes([step]) * 100
    with pytest.raises(RefusedError):
        store.delete(3)  # still the newest: the strays above it do not count
    assert store.steps() == [3]
    store.gc(grace=0)
    names = backend.raw_names()
    for stray in strays:
        assert any(n == stray or n.endswith("/" + stray) for n in names), (stray, names)
    if isinstance(backend, FileBackend):
        reported = {entry.step for entry in store.strays()}
        assert reported == {99999999999999999999, 60, 70}
        with pytest.raises(NotACheckpointError):
            store.get(99999999999999999999)
        with pytest.raises(NotACheckpointError):
            store.delete(70, force=True)


def test_a_damaged_manifest_above_is_not_counted_nor_deleted(backend: BackendUnderTest) -> None:
    """Bit rot in a newer manifest: retention keeps the real newest, and the damage stays."""
    store = backend.open(retention=KeepLast(1))
    for step in (1, 9):
        _save(store, step)
    backend.rewrite_manifest(store, 9, lambda data: data[: len(data) // 2])
    for step in (2, 3):
        _save(store, step)
        assert store.steps() == [step]
    with pytest.raises(RefusedError):
        store.delete(3)
    with pytest.raises(ManifestCorruptError):
        store.latest()  # a damaged newest checkpoint is never passed over silently
    latest = store.latest(verified=True)
    assert latest is not None and latest.step == 3
    assert [entry.step for entry in store.strays()] == [9]


def test_rollback_and_verified_latest_pass_over_strays(backend: BackendUnderTest) -> None:
    store = backend.open()
    for step in (1, 2):
        _save(store, step)
    _plant_strays(backend, store)
    latest = store.latest(verified=True)
    assert latest is not None and latest.step == 2
    assert store.rollback(1).left == [2]
    assert store.steps() == [1]
    if isinstance(backend, FileBackend):
        assert 99999999999999999999 in {entry.step for entry in store.strays()}


def test_latest_falls_back_when_hinted_candidates_vanish(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's rollback between the reader's listing and its reads (item 2)."""
    store = backend.open()
    for step in (1, 2, 3):
        _save(store, step)
    strategy = store.strategy
    listed = strategy.published_checkpoints

    def listing_then_rollback(min_step: int = 0) -> list[tuple[int, int]]:
        entries = listed(min_step)
        if min_step > 0:
            for step, _ in entries:
                if step > 1:
                    strategy.unpublish(step)  # raw unpublish: the hint still says 3
        return entries

    monkeypatch.setattr(strategy, "published_checkpoints", listing_then_rollback)
    assert strategy.read_latest_hint() == 3
    latest = store.latest()
    assert latest is not None and latest.step == 2


def test_checkpoint_unpublished_during_get_is_not_found_not_corrupt(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention unpublishes a checkpoint while a reader checks it (item 3)."""
    store = backend.open()
    for step in (1, 2):
        _save(store, step)
    strategy = store.strategy
    check = strategy.shard_problems

    def unpublished_meanwhile(manifest: Manifest) -> Any:
        if manifest.step == 2:
            backend.open().delete(2, force=True)
        return check(manifest)

    monkeypatch.setattr(strategy, "shard_problems", unpublished_meanwhile)
    with pytest.raises(CheckpointNotFoundError) as raised:
        store.get(2)
    assert not isinstance(raised.value, ManifestCorruptError)
    latest = store.latest()
    assert latest is not None and latest.step == 1


def test_manifest_gone_between_listing_and_read_is_not_found(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = backend.open()
    for step in (1, 2):
        _save(store, step)
    strategy = store.strategy
    listed = strategy.published_checkpoints

    def listing_then_retention(min_step: int = 0) -> list[tuple[int, int]]:
        entries = listed(min_step)
        if (2, 0) in entries and strategy.is_published(2):
            backend.open().delete(2, force=True)
        return entries

    monkeypatch.setattr(strategy, "published_checkpoints", listing_then_retention)
    latest = store.latest()
    assert latest is not None and latest.step == 1


def test_reading_a_checkpoint_deleted_meanwhile_is_not_found(backend: BackendUnderTest) -> None:
    store = backend.open()
    for step in (1, 2):
        _save(store, step)
    checkpoint = store.get(1)
    backend.open().delete(1)
    with pytest.raises(CheckpointNotFoundError) as raised:
        checkpoint.read("w.bin")
    assert not isinstance(raised.value, ManifestCorruptError)
    report_error = None
    try:
        checkpoint.verify()
    except CheckpointNotFoundError as exc:
        report_error = exc
    assert report_error is not None


def test_deeply_nested_manifest_is_corrupt_not_a_recursion_error(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    for step in (1, 2):
        _save(store, step)
    backend.rewrite_manifest(store, 2, lambda _: b"[" * 100_000)
    with pytest.raises(ManifestCorruptError):
        store.latest()
    latest = store.latest(verified=True)
    assert latest is not None and latest.step == 1
    with pytest.raises(ManifestCorruptError, match="deeper"):
        Manifest.decode(b'{"a":' * 100_000, where="test")


def test_deep_or_unencodable_metadata_is_refused_before_any_write(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    deep: Any = "leaf"
    for _ in range(MAX_METADATA_DEPTH + 1):
        deep = {"a": deep}
    with pytest.raises(InvalidMetadataError, match="deeper"):
        store.begin(1, {"deep": deep})
    very_deep: Any = []
    for _ in range(100_000):
        very_deep = [very_deep]
    with pytest.raises(InvalidMetadataError):
        store.begin(1, {"deep": very_deep})
    with pytest.raises(InvalidMetadataError, match="surrogate"):
        store.begin(1, {"a": "\ud800"})
    with pytest.raises(InvalidMetadataError, match="surrogate"):
        store.begin(1, {"\udc80": 1})
    assert store.is_empty()
    nested: Any = 1
    for _ in range(MAX_METADATA_DEPTH - 1):
        nested = [nested]
    store.save(1, {"w.bin": b"x"}, metadata={"nested": nested})
    latest = store.latest()
    assert latest is not None and latest.metadata["nested"] == nested


@pytest.mark.parametrize("hint", [b"100000000000000000005\n", b"\xff\xfe", b"-3", b"1_0"])
def test_an_absurd_hint_is_ignored_and_repaired(
    backend: BackendUnderTest, hint: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    store = backend.open()
    for step in (1, 2):
        _save(store, step)
    if isinstance(backend, FileBackend):
        with open(os.path.join(backend.root, "LATEST"), "wb") as f:
            f.write(hint)
    else:
        _put_raw(backend, store, "LATEST", hint)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        for _ in range(3):
            latest = store.latest()
            assert latest is not None and latest.step == 2
    assert len([r for r in caplog.records if "LATEST" in r.getMessage()]) <= 1
    _save(store, 3)
    assert store.strategy.read_latest_hint() == 3


def test_a_hint_past_every_checkpoint_is_repaired_by_the_next_publish(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    _save(store, 1)
    store.strategy.reset_latest_hint(99999999999999999999)
    latest = store.latest()
    assert latest is not None and latest.step == 1
    _save(store, 2)
    assert store.strategy.read_latest_hint() == 2


def test_a_directory_named_latest_is_ignored(tmp_path: Any) -> None:
    backend = FileBackend(tmp_path)
    store = backend.open()
    _save(store, 1)
    os.unlink(os.path.join(backend.root, "LATEST"))
    os.mkdir(os.path.join(backend.root, "LATEST"))
    latest = store.latest()
    assert latest is not None and latest.step == 1
    _save(store, 2)  # publishes; the hint cannot be rewritten, and no temporary is left
    latest = store.latest()
    assert latest is not None and latest.step == 2
    assert not [n for n in os.listdir(backend.root) if n.startswith(".LATEST.tmp")]


def test_memory_backend_strays_have_no_effect_on_gc(tmp_path: Any) -> None:
    backend = MemoryBackend(tmp_path)
    try:
        store = backend.open()
        _save(store, 1)
        _plant_strays(backend, store)
        store.gc(grace=0)
        assert "runs/r1/step-00000000000000000070.partial-copy/w.bin" in backend.raw_names()
    finally:
        backend.close()


def test_a_fifo_planted_as_a_shard_is_damage_not_a_hang(tmp_path: Any) -> None:
    backend = FileBackend(tmp_path)
    store = backend.open()
    _save(store, 1)
    checkpoint = store.get(1)
    path = os.path.join(backend.root, "step-00000000000000000001", "data", "w.bin")
    os.unlink(path)
    os.mkfifo(path)
    with pytest.raises(ShardCorruptError):
        store.get(1)
    report = checkpoint.verify()
    assert not report.ok and "not a regular file" in report.problems["w.bin"]


def test_the_delete_guard_reads_the_newest_manifest_afresh(backend: BackendUnderTest) -> None:
    store = backend.open()
    for step in (1, 2, 3):
        _save(store, step)
    assert store.steps() == [1, 2, 3]  # every manifest now confirmed and cached
    backend.rewrite_manifest(store, 3, lambda data: data[: len(data) // 2])
    with pytest.raises(RefusedError):
        store.delete(2)  # the newest intact checkpoint now


def test_a_shard_vanishing_mid_read_is_the_checkpoints_deletion(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed read that finds the object gone (S3) is not a raw storage error."""
    store = backend.open()
    for step in (1, 2):
        _save(store, step)
    opened = store.strategy.open_shard_reader

    class Vanishing:
        def __init__(self, raw: Any) -> None:
            self.raw = raw

        def read(self, size: int = -1) -> bytes:
            raise ObjectNotFoundError(2, "GetObject: replaced or deleted while being read")

        readinto = read

        def close(self) -> None:
            self.raw.close()

    monkeypatch.setattr(store.strategy, "open_shard_reader", lambda m, r: Vanishing(opened(m, r)))
    with pytest.raises(ShardMissingError, match="disappeared"):
        store.get(2).read("w.bin")  # still published: the shard is missing
    checkpoint = store.get(1)
    backend.open().delete(1)
    with pytest.raises(CheckpointNotFoundError):
        checkpoint.read("w.bin")


def test_dropping_one_ranks_pending_checkpoint_keeps_the_others_durable(tmp_path: Any) -> None:
    """Two ranks in one process join one attempt; one is dropped after sealing."""
    store = FileBackend(tmp_path).open()
    driver = store.strategy.driver  # type: ignore[attr-defined]
    paths: dict[int, str] = {}
    synced: list[str] = []
    create, fsync = driver.create, driver.fsync

    def recording_create(path: str) -> int:
        handle = create(path)
        paths[handle] = path
        return int(handle)

    def recording_fsync(handle: int) -> None:
        synced.append(paths.get(handle, "?"))
        fsync(handle)

    driver.create, driver.fsync = recording_create, recording_fsync
    coordinator = store.begin(1, world_size=2)
    one, two = store.join(1, coordinator.attempt), store.join(1, coordinator.attempt)
    one.write("r0.bin", b"0" * 100)
    receipts = one.seal()
    two.write("r1.bin", b"1" * 100)  # closed, held open with its writeback started
    del one
    gc.collect()  # the dropped rank's finalizer runs
    receipts += two.seal()
    assert any(p.endswith("data/r1.bin") for p in synced), synced
    coordinator.add_receipts(receipts)
    coordinator.publish()
    latest = store.latest()
    assert latest is not None and latest.read("r1.bin") == b"1" * 100
