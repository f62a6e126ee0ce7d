"""Names, URLs and manifests: what is accepted, what is refused, and with which error."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from ckptstore import open as open_store
from ckptstore.checksum import Crc32c, crc32c_hex
from ckptstore.errors import (
    InvalidOptionError,
    InvalidURLError,
    ManifestCorruptError,
    UnknownSchemeError,
)
from ckptstore.manifest import MAX_MANIFEST_BYTES, Manifest, ShardRecord, WriterInfo
from ckptstore.names import check_shard_name, new_attempt_id, parse_step_token, step_token
from ckptstore.urls import parse_url


def _manifest(**changes: object) -> Manifest:
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
    fields: dict[str, object] = {
        "step": 12,
        "attempt": new_attempt_id(),
        "shards": (ShardRecord("a/b", 3, crc32c_hex(b"abc"), {"path": "data/a/b"}),),
        "writer": WriterInfo("host", 42, 8, 0),
        "created_at": now,
        "committed_at": now,
        "timings": {"write_s": 1.5},
        "metadata": {"samples": 10, "nested": {"x": [1, 2.5, None, True]}},
        "backend": "posix-rename",
    }
    fields.update(changes)
    return Manifest(**fields)  # type: ignore[arg-type]


def test_manifest_round_trip():
    manifest = _manifest()
    assert Manifest.decode(manifest.encode(), where="x") == manifest


def test_manifest_checksum_catches_any_edit():
    data = _manifest().encode()
    edited = data.replace(b'"samples": 10', b'"samples": 11')
    with pytest.raises(ManifestCorruptError, match="checksum"):
        Manifest.decode(edited, where="x")


def test_manifest_size_bound():
    with pytest.raises(ManifestCorruptError, match="larger"):
        Manifest.decode(b" " * (MAX_MANIFEST_BYTES + 1), where="x")


def test_manifest_rejects_duplicate_shards():
    record = ShardRecord("a", 0, "00000000", {"path": "data/a"})
    with pytest.raises(ManifestCorruptError, match="twice"):
        Manifest.decode(_manifest(shards=(record, record)).encode(), where="x")


def test_manifest_wrong_step():
    with pytest.raises(ManifestCorruptError, match="for step 12"):
        Manifest.decode(_manifest().encode(), where="x", expected_step=13)


def test_manifest_is_readable_json():
    document = json.loads(_manifest().encode())
    assert document["format"] == "ckptstore.manifest"
    assert document["shards"][0]["crc32c"] == crc32c_hex(b"abc")


@pytest.mark.parametrize("name", ["a", "a/b/c", "model/rank00003.safetensors", ".hidden", "a..b"])
def test_valid_shard_names(name):
    assert check_shard_name(name) == name


def test_step_tokens_sort_numerically():
    tokens = [step_token(s) for s in (10, 9, 100, 0)]
    assert sorted(tokens) == [step_token(s) for s in (0, 9, 10, 100)]
    assert parse_step_token(step_token(123)) == 123
    assert parse_step_token("step-123") is None
    assert parse_step_token(step_token(5) + ".pending-x") is None


def test_attempt_ids_are_unique():
    assert len({new_attempt_id() for _ in range(1000)}) == 1000


def test_crc32c_streaming_matches_one_shot():
    crc = Crc32c()
    for chunk in (b"a", bytearray(b"bc"), memoryview(b"def")):
        crc.update(chunk)
    assert crc.hexdigest() == crc32c_hex(b"abcdef")
    assert crc.size == 6


def test_crc32c_known_value():
    assert crc32c_hex(b"123456789") == "e3069283"  # the CRC-32C check value


def test_urls():
    assert parse_url("/a/b").scheme == "file"
    assert parse_url("relative/dir").path.endswith("relative/dir")
    parsed = parse_url("memory://bucket/pre/fix?part_size=10&x=1")
    assert (parsed.scheme, parsed.netloc, parsed.path) == ("memory", "bucket", "/pre/fix")
    assert parsed.query == {"part_size": "10", "x": "1"}
    with pytest.raises(InvalidURLError):
        parse_url("")
    with pytest.raises(InvalidURLError):
        parse_url("file:///a#frag")


def test_unknown_scheme_lists_known_ones():
    with pytest.raises(UnknownSchemeError, match=r"known schemes: .*file://") as caught:
        open_store("gopher://x/y")
    for scheme in ("lustre://", "memory://", "s3://", "s3+versioned://"):
        assert scheme in str(caught.value)


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("file://host/path", InvalidURLError, "absolute path"),
        ("file:///tmp/x?unknown=1", InvalidOptionError, "unknown option"),
        ("memory://", InvalidURLError, "name a bucket"),
        ("memory://b1/p?part_size=abc", InvalidOptionError, "integer"),
        ("memory://b2/p?min_part_size=100&part_size=10", InvalidOptionError, "minimum part"),
        ("memory://b3/p?versioned=maybe", InvalidOptionError, "boolean"),
    ],
)
def test_bad_urls_and_options(url, error, match):
    with pytest.raises(error, match=match):
        open_store(url)


def test_memory_bucket_settings_must_match():
    open_store("memory://fixed-nature/p?versioned=true")
    open_store("memory://fixed-nature/q")
    with pytest.raises(InvalidOptionError, match="versioned=True"):
        open_store("memory://fixed-nature/p?versioned=false")
