"""Block checksums: a shard's manifest entry carries a CRC32C per block, so a read of part of a
shard reads and checks only the blocks it touches; older manifests still read (whole shard)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptstore
import ckptstore.checksum
from ckptstore import InvalidInputError
from ckptstore.checksum import BlockCrc32c, crc32c_combine, crc32c_hex, crc32c_of
from ckptstore.errors import ManifestCorruptError, ShardCorruptError
from ckptstore.manifest import ShardRecord

BLOCK = 4096


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3 * BLOCK), st.binary(max_size=3 * BLOCK))
def test_combined_crcs_are_the_crc_of_the_concatenation(first: bytes, second: bytes) -> None:
    assert crc32c_combine(crc32c_of(first), crc32c_of(second), len(second)) == crc32c_of(
        first + second
    )


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=5 * 64), st.lists(st.integers(1, 200), max_size=20), st.integers(1, 64))
def test_block_checksums_in_one_pass(data: bytes, cuts: list[int], block: int) -> None:
    checksum = BlockCrc32c(block)
    position = 0
    for cut in [*cuts, len(data)]:
        checksum.update(memoryview(bytearray(data[position : position + cut])))
        position += cut
    assert checksum.size == len(data)
    assert checksum.hexdigest() == crc32c_hex(data)
    blocks = checksum.block_hexdigests()
    assert blocks == "".join(crc32c_hex(data[i : i + block]) for i in range(0, len(data), block))


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckptstore.checksum, "BLOCK_SIZE", BLOCK)


@pytest.fixture(params=["file", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, small_blocks: None) -> Any:
    if request.param == "file":
        return ckptstore.open(f"file://{tmp_path}/s")
    if request.param == "memory":
        return ckptstore.open(f"memory://blocks-{tmp_path.name}/s")
    server = request.getfixturevalue("moto_s3")
    return ckptstore.open(server.url(f"blocks-{os.getpid()}-{tmp_path.name}"), **server.options)


DATA = bytes((i * 7 + i // 4099) % 256 for i in range(5 * BLOCK + 123))


def test_manifests_record_a_crc_per_block(store: Any) -> None:
    record = store.save(1, {"w": DATA, "empty": b""}).shards["w"]
    assert record.block_size == BLOCK
    assert record.block_crc32c == "".join(
        crc32c_hex(DATA[i : i + BLOCK]) for i in range(0, len(DATA), BLOCK)
    )
    assert store.get(1).shards["empty"].block_crc32c == ""


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, len(DATA)), (0, 1), (BLOCK - 1, 2), (BLOCK, BLOCK), (BLOCK + 5, 3 * BLOCK),
     (len(DATA) - 1, 1), (len(DATA), 0), (2 * BLOCK + 17, 123)],
)  # fmt: skip
def test_a_range_reads_back_exactly(store: Any, offset: int, length: int) -> None:
    checkpoint = store.save(1, {"w": DATA})
    assert bytes(checkpoint.read_range("w", offset, length)) == DATA[offset : offset + length]
    into = bytearray(length + 10)
    view = checkpoint.read_range("w", offset, length, into)
    assert view.nbytes == length and bytes(into[:length]) == DATA[offset : offset + length]


def test_bad_ranges_are_refused(store: Any) -> None:
    checkpoint = store.save(1, {"w": DATA})
    for offset, length in [(-1, 2), (0, len(DATA) + 1), (len(DATA), 1), (3, -1)]:
        with pytest.raises(InvalidInputError, match="outside"):
            checkpoint.read_range("w", offset, length)
    with pytest.raises(InvalidInputError, match="writable"):
        checkpoint.read_range("w", 0, 10, bytes(10))
    with pytest.raises(InvalidInputError, match="hold 10"):
        checkpoint.read_range("w", 0, 10, bytearray(9))


def _damage(tmp_path: Path, position: int) -> None:
    shard = tmp_path / "s" / f"step-{1:020d}" / "data" / "w"
    data = bytearray(shard.read_bytes())
    data[position] ^= 0x01
    shard.write_bytes(bytes(data))


def test_only_the_blocks_a_range_touches_are_checked(tmp_path: Path, small_blocks: None) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    checkpoint = store.save(1, {"w": DATA})
    _damage(tmp_path, 3 * BLOCK + 10)  # block 3
    assert bytes(checkpoint.read_range("w", BLOCK, 2 * BLOCK)) == DATA[BLOCK : 3 * BLOCK]
    with pytest.raises(ShardCorruptError, match="block 3"):
        checkpoint.read_range("w", 3 * BLOCK + 100, 1)  # the damaged byte is not in range
    with pytest.raises(ShardCorruptError, match="block 3"):
        checkpoint.read_range("w", 0, len(DATA))
    with pytest.raises(ShardCorruptError):
        checkpoint.read("w")


def test_a_manifest_written_before_blocks_reads_ranges_checked_whole(
    tmp_path: Path, small_blocks: None
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    store.save(1, {"w": DATA})
    manifest_path = tmp_path / "s" / f"step-{1:020d}" / "manifest.json"
    document = json.loads(manifest_path.read_text())
    for shard in document["shards"]:
        del shard["block_size"], shard["block_crc32c"]
    from ckptstore.manifest import _document_checksum

    document["checksum"] = _document_checksum(document)
    manifest_path.write_text(json.dumps(document))
    checkpoint = ckptstore.open(f"file://{tmp_path}/s").get(1)
    assert checkpoint.shards["w"].block_size == 0
    assert bytes(checkpoint.read_range("w", BLOCK + 3, 50)) == DATA[BLOCK + 3 : BLOCK + 53]
    _damage(tmp_path, 4 * BLOCK)
    with pytest.raises(ShardCorruptError, match="CRC32C mismatch"):
        checkpoint.read_range("w", 0, 10)  # the whole shard is checked


@pytest.mark.parametrize(
    ("block_size", "blocks"),
    [(4096, "zz" * 4), (4096, "00" * 4), (0, ""), (-1, ""), (4096, 7), ("4096", "00000000")],
)
def test_bad_block_entries_are_corruption(
    tmp_path: Path, small_blocks: None, block_size: object, blocks: object
) -> None:
    store = ckptstore.open(f"file://{tmp_path}/s")
    store.save(1, {"w": b"x" * 5000})
    manifest_path = tmp_path / "s" / f"step-{1:020d}" / "manifest.json"
    document = json.loads(manifest_path.read_text())
    document["shards"][0].update(block_size=block_size, block_crc32c=blocks)
    from ckptstore.manifest import _document_checksum

    document["checksum"] = _document_checksum(document)
    manifest_path.write_text(json.dumps(document))
    with pytest.raises(ManifestCorruptError):
        ckptstore.open(f"file://{tmp_path}/s").get(1)


def test_block_range() -> None:
    record = ShardRecord("w", 10_000, "00000000", {}, block_size=BLOCK, block_crc32c="0" * 24)
    assert record.block_range(0, 1) == range(0, 1)
    assert record.block_range(BLOCK - 1, 2) == range(0, 2)
    assert record.block_range(BLOCK, BLOCK) == range(1, 2)
    assert record.block_range(5, 0) == range(0)
    assert ShardRecord("w", 10, "00000000", {}).block_range(0, 5) == range(0)
