"""Incremental saves on file://: unchanged shards are shared by hard links, never lost to
retention or GC (I10, docs/protocol.md §12.2)."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.backends.fsspec import UNSAFE_OPTION
from ckptstore.checksum import crc32c_hex
from ckptstore.commit.blob_area import BLOB_AREA, bucket_path
from ckptstore.errors import InvalidOptionError

MiB = 2**20


def _open(tmp_path: Path, **options: Any) -> ckptstore.Store:
    return ckptstore.open(f"file://{tmp_path}/store", incremental=True, **options)


def _shard_file(tmp_path: Path, step: int, name: str) -> Path:
    return tmp_path / "store" / f"step-{step:020d}" / "data" / name


def _area_entries(tmp_path: Path) -> list[Path]:
    area = tmp_path / "store" / BLOB_AREA
    return sorted(p for p in area.rglob("*") if p.is_file()) if area.exists() else []


def test_an_unchanged_shard_is_shared_and_a_changed_one_written(tmp_path: Path) -> None:
    store = _open(tmp_path)
    base = os.urandom(5 * MiB + 17)  # more than one block, a short last one
    adapters = [os.urandom(MiB) for _ in range(3)]
    for step, adapter in enumerate(adapters, start=1):
        store.save(step, {"model/base.bin": base, "model/lora.bin": adapter})
    inodes = {os.stat(_shard_file(tmp_path, s, "model/base.bin")).st_ino for s in (1, 2, 3)}
    assert len(inodes) == 1  # one file, three checkpoints' links (and the area's)
    assert os.stat(_shard_file(tmp_path, 3, "model/base.bin")).st_nlink == 4
    lora = {os.stat(_shard_file(tmp_path, s, "model/lora.bin")).st_ino for s in (1, 2, 3)}
    assert len(lora) == 3
    for step, adapter in enumerate(adapters, start=1):
        checkpoint = store.get(step)
        assert checkpoint.read("model/base.bin") == base
        assert checkpoint.read("model/lora.bin") == adapter
        assert checkpoint.verify().ok
        record = {r.name: r for r in checkpoint.manifest.shards}["model/base.bin"]
        assert not record.digest  # found by its CRC32C, compared byte for byte
        assert record.locator == {"path": "data/model/base.bin"}  # read as any other shard
    assert len(_area_entries(tmp_path)) == 4  # the base and three adapters, each once
    reopened = ckptstore.open(f"file://{tmp_path}/store")  # a reader not incremental
    assert reopened.latest() is not None and reopened.get(1).read("model/base.bin") == base


def test_deleting_checkpoints_and_gc_never_free_a_shared_shard(tmp_path: Path) -> None:
    store = _open(tmp_path)
    base = os.urandom(2 * MiB)
    for step in (1, 2, 3):
        store.save(step, {"base": base, "step": str(step).encode()})
    store.delete(1)
    store.delete(2)
    report = store.gc(grace=0)
    removed = {item.name for item in report.removed if item.kind == "blob"}
    # The first two "step" shards' entries had no checkpoint left: removed; the rest kept.
    assert len(removed) == 2
    bucket = tmp_path / "store" / bucket_path(crc32c_hex(base), len(base))
    assert [p.name for p in bucket.iterdir()] and not removed & {
        str(p.relative_to(tmp_path / "store")) for p in bucket.iterdir()
    }
    assert store.get(3).read("base") == base and store.get(3).verify().ok
    assert all(os.stat(p).st_nlink == 2 for p in _area_entries(tmp_path))
    store.delete(3, force=True)
    store.gc(grace=0)
    assert _area_entries(tmp_path) == []  # nothing links the bytes any more: all gone


def test_gc_keeps_young_entries_and_a_dry_run_removes_nothing(tmp_path: Path) -> None:
    store = _open(tmp_path)
    store.save(1, {"a": b"x" * 1000})
    store.save(2, {"a": b"y" * 1000})
    store.delete(1)
    assert [i.kind for i in store.gc().kept_young if i.kind == "blob"] == ["blob"]
    dry = store.gc(grace=0, dry_run=True)
    assert [i.kind for i in dry.removed if i.kind == "blob"] == ["blob"]
    assert len(_area_entries(tmp_path)) == 2
    store.gc(grace=0)
    assert len(_area_entries(tmp_path)) == 1


def test_gc_unlinking_an_entry_a_writer_just_shared_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of §12.2: GC counts one link, a save links the entry, GC unlinks it."""
    store = _open(tmp_path)
    base = os.urandom(MiB)
    store.save(1, {"base": base})
    store.delete(1, force=True)  # the area's entry is the only link left
    driver = store.strategy.driver
    real_links = driver.links
    writer = _open(tmp_path)

    def counted_then_shared(path: str) -> Any:
        answer = real_links(path)  # GC's count: 1
        writer.save(2, {"base": base})  # the writer shares the entry before GC unlinks it
        return answer

    monkeypatch.setattr(driver, "links", counted_then_shared)
    report = store.gc(grace=0)
    assert [i.kind for i in report.removed] == ["blob"]  # only the index went
    assert _area_entries(tmp_path) == []
    monkeypatch.undo()
    checkpoint = ckptstore.open(f"file://{tmp_path}/store").get(2)
    assert checkpoint.read("base") == base and checkpoint.verify().ok
    writer.save(3, {"base": base})  # written again (the index was lost), then indexed
    assert len(_area_entries(tmp_path)) == 1


def test_an_entry_whose_size_differs_from_its_name_is_not_shared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _open(tmp_path)
    data = os.urandom(100_000)
    store.save(1, {"a": data})
    (entry,) = _area_entries(tmp_path)
    store.delete(1, force=True)
    os.truncate(entry, 10)  # a damaged entry: its name promises 100,000 bytes
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        store.save(2, {"a": data})
    assert "holds 10 bytes" in caplog.text
    (indexed,) = _area_entries(tmp_path)  # the damaged entry replaced by the bytes written
    assert indexed != entry and indexed.read_bytes() == data
    assert store.get(2).read("a") == data and store.get(2).verify().ok


def test_links_planted_in_the_area_are_never_followed(tmp_path: Path) -> None:
    store = _open(tmp_path)
    data = os.urandom(10_000)
    store.save(1, {"a": data})
    (entry,) = _area_entries(tmp_path)
    store.delete(1, force=True)
    store.gc(grace=0)
    outside = tmp_path / "users-file"
    outside.write_bytes(data)
    entry.parent.mkdir(parents=True, exist_ok=True)  # GC removed the emptied bucket
    entry.symlink_to(outside)  # an entry's name, pointing out of the store
    store.save(2, {"a": data})  # not shared through the symbolic link: written
    assert not os.path.samefile(_shard_file(tmp_path, 2, "a"), outside)
    assert store.get(2).read("a") == data
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / entry.name
    victim.write_bytes(data)  # a user's file, named like an entry, one link
    bucket = entry.parent
    store.delete(2, force=True)
    store.gc(grace=0)  # the bucket emptied of its entries (the planted link is left)
    for child in bucket.iterdir():
        os.unlink(child)
    bucket.rmdir()
    bucket.symlink_to(elsewhere)  # a planted directory link
    (bucket.parent / "stray.txt").write_text("an operator's note")
    store.gc(grace=0)
    assert victim.read_bytes() == data  # never deleted through the link
    assert (bucket.parent / "stray.txt").exists()  # not the area's: left alone
    store.save(3, {"a": data})  # nothing shared from or indexed into the planted link
    assert sorted(p.name for p in elsewhere.iterdir()) == [entry.name]


def test_streams_are_written_then_shared_by_later_saves(tmp_path: Path) -> None:
    store = _open(tmp_path)
    data = os.urandom(3 * MiB)
    with store.begin(1) as pending, pending.open_shard("s") as shard:
        shard.write(data)  # streamed: written, then indexed when published
    store.save(2, {"s": data})
    assert os.path.samefile(_shard_file(tmp_path, 1, "s"), _shard_file(tmp_path, 2, "s"))


def test_incremental_with_signing_shares_and_verifies(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = tmp_path / "key.pem"
    key.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    store = _open(tmp_path, signing_key=str(key))
    base = os.urandom(MiB)
    store.save(1, {"base": base})
    store.save(2, {"base": base})
    assert os.path.samefile(_shard_file(tmp_path, 1, "base"), _shard_file(tmp_path, 2, "base"))
    assert store.get(2).verify().ok


@pytest.mark.parametrize(
    "url", ["fsspec+file://{tmp}/fs?{unsafe}=true", "file://{tmp}/x?incremental=1"]
)
def test_incremental_options(tmp_path: Path, url: str) -> None:
    if url.startswith("fsspec"):
        url = url.format(tmp=tmp_path, unsafe=UNSAFE_OPTION)
        with pytest.raises(InvalidOptionError, match="file systems with hard links"):
            ckptstore.open(url, incremental=True)
        with pytest.raises(InvalidOptionError, match="file systems with hard links"):
            ckptstore.open(url + "&incremental=1")
        ckptstore.open(url + "&incremental=0").save(1, {"a": b"1"})  # off: as any store
        return
    store = ckptstore.open(url.format(tmp=tmp_path))
    assert store.incremental and store.digest_algorithm is None  # no digest is needed
    with pytest.raises(InvalidOptionError):
        ckptstore.open(f"file://{tmp_path}/y?incremental=perhaps")


WRITER = textwrap.dedent(
    """
    import sys
    import ckptstore
    url, first = sys.argv[1], int(sys.argv[2])
    store = ckptstore.open(url, retention=ckptstore.KeepLast(2))
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
    import sys
    import ckptstore
    store = ckptstore.open(sys.argv[1])
    driver = store.strategy.driver
    unlink = driver.unlink

    def unlinked(path):
        unlink(path)
        print("unlinked", path, flush=True)

    driver.unlink = unlinked
    store.gc(grace=0)
    print("done", flush=True)
    """
)


def test_sigkill_of_incremental_writers_and_of_gc_loses_no_shared_shard(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store?incremental=1"
    base = bytes(range(256)) * 8192
    rng = random.Random(28)
    step = 0
    for trial in range(6):
        with subprocess.Popen(
            [sys.executable, "-c", WRITER, url, str(step + 1)], stdout=subprocess.PIPE, text=True
        ) as writer:
            assert writer.stdout is not None
            wanted = rng.randint(1, 3)  # saves to wait for, then kill at once: mid-save
            for _ in range(wanted):
                line = writer.stdout.readline()
                assert line.startswith("published"), line
                step = int(line.split()[1])
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()
        if trial % 2:  # a GC killed while it sweeps the area, after its first unlink
            with subprocess.Popen(
                [sys.executable, "-c", GC, url], stdout=subprocess.PIPE, text=True
            ) as gc:
                assert gc.stdout is not None
                if gc.stdout.readline().startswith("unlinked"):
                    os.kill(gc.pid, signal.SIGKILL)
                gc.wait()
        store = ckptstore.open(url)
        latest = store.latest()
        assert latest is not None and latest.step >= step
        for checkpoint in store.checkpoints():
            assert checkpoint.read("base") == base
            assert checkpoint.read("adapter") == bytes([checkpoint.step % 251]) * 300_000
            assert checkpoint.verify().ok
        step = latest.step
    store = ckptstore.open(url)
    store.gc(grace=0)
    for entry in _area_entries(tmp_path):
        assert os.stat(entry).st_nlink >= 2  # every entry left is linked by a checkpoint
    assert all(c.verify().ok for c in store.checkpoints())


def test_a_large_shard_is_shared_when_equal_and_written_when_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A candidate of the same CRC32C and size is compared byte for byte: a change in the
    last byte is seen; an entry GC removed between the listing and the link is written."""
    store = _open(tmp_path)
    big = bytearray(os.urandom(40 * MiB))
    store.save(1, {"big": big})
    store.save(2, {"big": big})  # unchanged: shared
    assert os.path.samefile(_shard_file(tmp_path, 1, "big"), _shard_file(tmp_path, 2, "big"))
    big[-1] ^= 1
    store.save(3, {"big": big})  # changed in its last byte: written whole
    assert not os.path.samefile(_shard_file(tmp_path, 2, "big"), _shard_file(tmp_path, 3, "big"))
    assert store.get(3).read("big") == big and store.get(2).read("big") != big
    assert list((tmp_path / "store").glob("*pending*")) == []
    area = store.strategy._blobs
    assert area is not None
    driver = area.driver
    real_link = driver.link

    def gone(source: str, target: str) -> int:
        if source.startswith(BLOB_AREA):
            from ckptstore.errors import ObjectNotFoundError

            raise ObjectNotFoundError(2, f"{source}: removed by GC")
        return real_link(source, target)

    monkeypatch.setattr(driver, "link", gone)
    store.save(4, {"big": big})  # listed, then gone: written after all, whole
    assert store.get(4).read("big") == big and store.get(4).verify().ok
    assert not os.path.samefile(_shard_file(tmp_path, 3, "big"), _shard_file(tmp_path, 4, "big"))
    for step in (1, 2, 3, 4):
        assert store.get(step).verify().ok


def test_a_collision_of_crc32c_and_size_is_not_shared(tmp_path: Path) -> None:
    """Two byte strings of one CRC32C and size: the second is compared, found different,
    written, and the first's entry kept (it is good, for the first's bytes)."""
    first = os.urandom(64)
    second = _same_crc32c(first)
    assert crc32c_hex(first) == crc32c_hex(second) and first != second
    store = _open(tmp_path)
    store.save(1, {"a": first})
    store.save(2, {"a": second})
    assert not os.path.samefile(_shard_file(tmp_path, 1, "a"), _shard_file(tmp_path, 2, "a"))
    assert store.get(2).read("a") == second and store.get(1).read("a") == first
    store.save(3, {"a": second})  # the bucket holds both now: the second's is found
    assert os.path.samefile(_shard_file(tmp_path, 2, "a"), _shard_file(tmp_path, 3, "a"))


def _same_crc32c(data: bytes) -> bytes:
    """Other bytes of ``data``'s length and CRC32C: the last 4 bytes solved for (CRC32C is
    linear: flip bits of the first byte, then pick the 4 bytes that restore the checksum)."""
    from ckptstore.checksum import crc32c_of

    changed = bytearray(data)
    changed[0] ^= 0xFF
    target = crc32c_of(data)
    columns = []
    for bit in range(32):
        probe = bytearray(changed)
        probe[-4:] = (1 << bit).to_bytes(4, "little")
        zero = bytearray(changed)
        zero[-4:] = b"\0\0\0\0"
        columns.append(crc32c_of(bytes(probe)) ^ crc32c_of(bytes(zero)))
    zero = bytearray(changed)
    zero[-4:] = b"\0\0\0\0"
    want = target ^ crc32c_of(bytes(zero))
    # Solve columns . x = want over GF(2) by elimination.
    rows = [(columns[bit], 1 << bit) for bit in range(32)]
    solution = 0
    for position in range(32):
        pivot = next((r for r in rows if r[0] >> position & 1), None)
        assert pivot is not None
        rows.remove(pivot)
        rows = [(a ^ pivot[0], b ^ pivot[1]) if a >> position & 1 else (a, b) for a, b in rows]
        if want >> position & 1:
            want ^= pivot[0]
            solution ^= pivot[1]
    changed[-4:] = solution.to_bytes(4, "little")
    return bytes(changed)


def test_the_operator_sees_what_is_shared(tmp_path: Path) -> None:
    """``ls`` and ``show`` say what checkpoints share and what the store holds; ``verify
    --all`` reads each shared file once; ``gc --dry-run`` says why a blob entry goes."""
    import io
    import json

    from ckptstore.cli import main

    url = f"file://{tmp_path}/store"
    store = _open(tmp_path)
    base = os.urandom(2 * MiB)
    for step in (1, 2, 3):
        store.save(step, {"base": base, "adapter": os.urandom(1000)})

    def run(*argv: str) -> str:
        out = io.StringIO()
        assert main([*argv], out) == 0, out.getvalue()
        return out.getvalue()

    listing = run("ls", url)
    assert "SHARED" in listing and listing.count("2.0 MiB  ok") == 3
    assert "stored: 2.0 MiB for checkpoints of 6.0 MiB in all" in listing
    document = json.loads(run("ls", url, "--json"))
    assert document["stored_bytes"] == 2 * MiB + 3000
    assert [c["shared_bytes"] for c in document["checkpoints"]] == [2 * MiB] * 3
    assert "2.0 MiB of it shared with other checkpoints" in run("show", url, "2")
    verified = run("verify", url, "--all")
    assert "step 1: ok (2.0 MiB checked)" in verified
    assert "1 shard(s) shared with one checked above" in verified
    store.delete(1)
    assert "(no checkpoint links it; idle" in run("gc", url, "--grace", "0", "--dry-run")
    plain = ckptstore.open(f"file://{tmp_path}/plain")
    plain.save(1, {"a": b"x"})
    assert "SHARED" not in run("ls", f"file://{tmp_path}/plain")  # as it always was
    assert "stored:" not in run("ls", f"file://{tmp_path}/plain")


def test_a_share_that_fails_fails_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A share that fails with a storage error fails the shard, so the checkpoint cannot
    publish without it."""
    from ckptstore.errors import CkptStoreError, StorageError

    store = _open(tmp_path)
    big = os.urandom(20 * MiB)
    store.save(1, {"big": big})
    area = store.strategy._blobs
    assert area is not None
    real = area.share

    def broken(crc32c: str, size: int, target: str, data: memoryview) -> bool:
        if size == len(big):
            raise StorageError(5, "link: input/output error")
        return real(crc32c, size, target, data)

    monkeypatch.setattr(area, "share", broken)
    pending = store.begin(2)
    with pytest.raises(StorageError):
        pending.write("big", big)
    pending.write("other", b"x")
    with pytest.raises(CkptStoreError):
        pending.publish()  # never a checkpoint without the shard the caller wrote
    assert store.steps() == [1]


@pytest.mark.parametrize("size", [100_000, 20 * MiB])
def test_a_shared_file_changed_in_place_is_not_spread_to_later_saves(
    tmp_path: Path, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a hostile review: a careless ``open(path, "wb")`` of a published shard keeps
    its inode, so every link to it changes; a later save of the right bytes must not link
    it: the entry is read back and compared with the bytes the save holds, and unindexed."""
    store = _open(tmp_path, retention=ckptstore.KeepLast(2))
    data = os.urandom(size)
    store.save(1, {"frozen": data})
    damaged = bytearray(data)
    damaged[size // 2] ^= 0xFF
    with open(_shard_file(tmp_path, 1, "frozen"), "r+b") as file:  # the same inode
        file.write(damaged)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        for step in (2, 3, 4):
            store.save(step, {"frozen": data})
    assert "holds bytes of CRC32C" in caplog.text and "removed from the index" in caplog.text
    for checkpoint in store.checkpoints():
        assert checkpoint.read("frozen") == data and checkpoint.verify().ok
    # the later saves share the good bytes among themselves
    assert os.path.samefile(_shard_file(tmp_path, 3, "frozen"), _shard_file(tmp_path, 4, "frozen"))


def test_joined_ranks_index_their_own_shards(tmp_path: Path) -> None:
    """Found by a hostile review: only the coordinator indexed (at publish), so a rank that
    joined the attempt never shared its shards with the next save."""
    coordinator = _open(tmp_path)
    rank = _open(tmp_path)
    data = [os.urandom(300_000), os.urandom(300_000)]
    for step in (1, 2):
        pending = coordinator.begin(step, expected_shards=["rank0", "rank1"])
        joined = rank.join(step, pending.attempt)
        joined.write("rank1", data[1])
        receipts = joined.seal()
        pending.write("rank0", data[0])
        pending.add_receipts(receipts)
        pending.publish()
    for name in ("rank0", "rank1"):
        assert os.path.samefile(_shard_file(tmp_path, 1, name), _shard_file(tmp_path, 2, name))


def test_a_blob_area_that_is_a_symbolic_link_is_never_used(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / BLOB_AREA).symlink_to(outside)
    store = _open(tmp_path)
    data = os.urandom(50_000)
    store.save(1, {"a": data})
    store.save(2, {"a": data})
    assert list(outside.rglob("*")) == []  # nothing indexed through the link
    assert not os.path.samefile(_shard_file(tmp_path, 1, "a"), _shard_file(tmp_path, 2, "a"))
    assert store.get(2).read("a") == data


def test_the_incremental_option_is_a_boolean(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="True or False"):
        ckptstore.open(f"file://{tmp_path}/a", incremental="false")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="give one"):
        ckptstore.open(f"file://{tmp_path}/a?incremental=0", incremental=True)
    assert ckptstore.open(f"file://{tmp_path}/a?incremental=1", incremental=True).incremental


def test_a_candidate_that_cannot_be_read_back_is_skipped_and_unindexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a second hostile review: an old file that fails its read-back (EIO, ESTALE)
    failed every later save of its bytes, forever; it is now skipped, unindexed, and the
    shard written."""
    from ckptstore.commit.blob_area import FileBlobArea

    store = _open(tmp_path)
    data = os.urandom(200_000)
    store.save(1, {"a": data})

    def unreadable(*args: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(FileBlobArea, "_compare", unreadable)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        store.save(2, {"a": data})
    assert "cannot be read back" in caplog.text and "removed from the index" in caplog.text
    monkeypatch.undo()
    assert store.get(2).read("a") == data and store.get(2).verify().ok
    store.save(3, {"a": data})  # shares the file step 2 wrote, indexed in the entry's place
    assert os.path.samefile(_shard_file(tmp_path, 2, "a"), _shard_file(tmp_path, 3, "a"))


def test_a_shard_is_indexed_once_and_gc_removes_an_emptied_area(tmp_path: Path) -> None:
    store = _open(tmp_path)
    with store.begin(1) as pending:
        pending.write("a", b"x" * 5000)
        pending.seal()  # a seal, then the publish's: one entry, not two of one file
    assert len(_area_entries(tmp_path)) == 1
    store.delete(1, force=True)
    store.gc(grace=0)
    assert not (tmp_path / "store" / BLOB_AREA).exists()  # nothing of the area is left


def test_an_empty_multidimensional_array_is_an_empty_shard(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    for store in (_open(tmp_path), ckptstore.open(f"file://{tmp_path}/plain")):
        store.save(1, {"z": np.zeros((0, 5), dtype=np.float32)})
        assert store.get(1).read("z") == b""
