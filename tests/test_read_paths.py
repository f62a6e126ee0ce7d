"""Whole-shard reads take the fastest path the storage allows (a large shard read as segments
at once, each from its own stream) and still return only the committed bytes: a flipped byte
in any segment, a shorter or a longer shard, each is refused, on every backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BackendUnderTest

import ckptstore.checkpoint
from ckptstore.errors import ShardCorruptError

PIECE = 1024
DATA = bytes(range(256)) * 64  # 16 KiB: 16 pieces, read as two segments of 8 KiB


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckptstore.checkpoint, "_HOT_PIECE", PIECE)
    monkeypatch.setattr(ckptstore.checkpoint, "_PIPELINE_PIECE", 4 * PIECE)


def _flip(position: int) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        changed = bytearray(data)
        changed[position] ^= 0x01
        return bytes(changed)

    return edit


def test_a_large_shard_reads_whole_and_exact(
    backend: BackendUnderTest, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths: list[str] = []
    read_in_segments = ckptstore.checkpoint.Checkpoint._read_in_segments
    read_ranged = ckptstore.checkpoint.Checkpoint._read_ranged

    def spy_halves(self: ckptstore.checkpoint.Checkpoint, *args: object) -> bool:
        done = read_in_segments(self, *args)  # type: ignore[arg-type]
        paths.append("segments" if done else "one stream")
        return done

    def spy_ranged(self: ckptstore.checkpoint.Checkpoint, *args: object) -> None:
        paths.append("ranged")
        read_ranged(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ckptstore.checkpoint.Checkpoint, "_read_in_segments", spy_halves)
    monkeypatch.setattr(ckptstore.checkpoint.Checkpoint, "_read_ranged", spy_ranged)
    store = backend.open()
    store.save(1, {"w": DATA})
    buffer = bytearray(len(DATA))
    assert store.get(1).read_into("w", buffer) == len(DATA)
    assert bytes(buffer) == DATA
    # every backend here reads ranges in parallel (S3) or can seek (the segments path)
    ranged = hasattr(store.strategy.driver, "read_range")
    assert paths == ["ranged" if ranged else "segments"]
    assert store.get(1).read("w") == DATA


@pytest.mark.parametrize(
    "edit",
    [
        _flip(10),  # the first segment
        _flip(8192),  # the first byte of the second
        _flip(8192 - 1),  # the last byte of the first
        _flip(len(DATA) - 10),  # the end of the second
        lambda data: data[:-1],  # shorter than recorded
        lambda data: data + b"\0",  # longer than recorded
    ],
    ids=["first", "second-start", "first-end", "last", "truncated", "extended"],
)
def test_a_damaged_large_shard_is_refused(
    backend: BackendUnderTest, edit: Callable[[bytes], bytes]
) -> None:
    store = backend.open()
    store.save(1, {"w": DATA})
    backend.rewrite_shard(store, 1, "w", edit)
    with pytest.raises(ShardCorruptError, match="'w'"):
        store.get(1).read_into("w", bytearray(len(DATA)))
    with pytest.raises(ShardCorruptError, match="'w'"):
        store.get(1).read("w")


class _Unseekable:
    """A stream that reads but cannot seek (a pipe, a storage without ranged reads)."""

    def __init__(self, raw: object) -> None:
        self._raw = raw

    def readinto(self, view: memoryview) -> int:
        return self._raw.readinto(view)  # type: ignore[attr-defined,no-any-return]

    def read(self, size: int = -1) -> bytes:
        return self._raw.read(size)  # type: ignore[attr-defined,no-any-return]

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self._raw.close()  # type: ignore[attr-defined]


def test_a_storage_that_cannot_seek_is_read_in_one_stream(tmp_path: object) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    store.save(1, {"w": DATA})
    checkpoint = store.get(1)
    opener = checkpoint._opener
    opened = []

    def unseekable(*args: object) -> _Unseekable:
        opened.append(1)
        return _Unseekable(opener(*args))  # type: ignore[arg-type]

    checkpoint._opener = unseekable  # type: ignore[assignment]
    buffer = bytearray(len(DATA))
    assert checkpoint.read_into("w", buffer) == len(DATA) and bytes(buffer) == DATA
    assert len(opened) == 2  # the probe, then the one stream that read it all


@pytest.mark.parametrize("size", [8192, 8193, 12 * 1024 + 700, 16 * 1024 - 1, 40 * 1024 + 3])
def test_every_size_reads_exact_in_segments_and_a_flip_anywhere_is_refused(
    tmp_path: Path, size: int
) -> None:
    data = (bytes(range(251)) * (size // 251 + 1))[:size]
    store = ckptstore.open(f"file://{tmp_path}/s")
    store.save(1, {"w": data})
    buffer = bytearray(size)
    assert store.get(1).read_into("w", buffer) == size and bytes(buffer) == data
    (stored,) = [p for p in (tmp_path / "s").rglob("w") if p.is_file()]
    for position in (0, size // 3, size // 2, 3 * size // 4, size - 1):
        damaged = bytearray(data)
        damaged[position] ^= 0x80
        stored.chmod(0o600)
        stored.write_bytes(bytes(damaged))
        with pytest.raises(ShardCorruptError, match="CRC32C mismatch"):
            store.get(1).read_into("w", bytearray(size))
