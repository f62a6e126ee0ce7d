"""The manifest is the commit: a checksummed JSON document listing every shard of a checkpoint.

A manifest records, for each shard, its name, size, CRC32C and locator (where the backend put
its bytes), plus the step, the attempt id, the writer, the creation and commit times, the save's
measured durations and the trainer's free-form metadata. ``decode`` trusts nothing: it bounds
the size, checks the schema, every shard name (docs/protocol.md §1) and the manifest's own checksum.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

from ckptstore.checksum import crc32c_hex
from ckptstore.digest import ALGORITHMS, digest_length
from ckptstore.errors import (
    InvalidInputError,
    InvalidMetadataError,
    ManifestCorruptError,
    UntrustedCheckpointError,
)
from ckptstore.jsonload import JSONDocumentError, load_json
from ckptstore.names import check_attempt_id, check_epoch, check_shard_name, check_step
from ckptstore.signing import Signature, SigningKey, Trust, signed_payload

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH",
    "Manifest",
    "ReplicaSource",
    "ShardRecord",
    "WriterInfo",
    "check_metadata",
]

FORMAT_NAME = "ckptstore.manifest"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_METADATA_BYTES = 16 * 1024 * 1024
MAX_METADATA_DEPTH = 64
"""Nesting of lists and objects in trainer metadata; the manifest adds two levels around it."""
MAX_MANIFEST_DEPTH = MAX_METADATA_DEPTH + 2

JSONValue: TypeAlias = "str | int | float | bool | list[JSONValue] | dict[str, JSONValue] | None"
"""A value of trainer metadata, as JSON has it (and as it comes back from a manifest)."""
JSONObject = Mapping[str, JSONValue]


@dataclass(frozen=True)
class ShardRecord:
    """One shard as committed: name, exact size, CRC32C (8 hex digits) and backend locator.

    ``block_crc32c``: the CRC32C of each ``block_size`` piece of the shard (8 hex digits each,
    the last piece may be short), so that a read of part of the shard checks what it reads;
    empty (and ``block_size`` 0) in manifests written before blocks were recorded.
    """

    name: str
    size: int
    crc32c: str
    locator: Mapping[str, str]
    block_size: int = 0
    block_crc32c: str = ""
    digest: str = ""
    """``<algorithm>:<hex>``, the shard's cryptographic digest (``ckptstore.digest``), or
    empty: recorded by a store that computes digests (every store that signs)."""
    block_digests: str = ""
    """The digest of each ``block_size`` piece, in hex, in order (empty without ``digest``)."""

    @property
    def digest_algorithm(self) -> str:
        """The algorithm of ``digest`` (empty if the shard has none)."""
        return self.digest.partition(":")[0]

    def block_range(self, offset: int, length: int) -> range:
        """The indexes of the blocks that bytes ``offset``..``offset + length`` touch."""
        if not self.block_size or length <= 0:
            return range(0)
        return range(offset // self.block_size, (offset + length - 1) // self.block_size + 1)


@dataclass(frozen=True)
class WriterInfo:
    """Who wrote a checkpoint: host, process id, world size and the publishing rank."""

    host: str
    pid: int
    world_size: int = 1
    rank: int = 0

    @classmethod
    def current(cls, world_size: int = 1, rank: int = 0) -> WriterInfo:
        """Describe this process."""
        return cls(host=socket.gethostname(), pid=os.getpid(), world_size=world_size, rank=rank)


@dataclass(frozen=True)
class ReplicaSource:
    """Where a replicated checkpoint was first published: the store (its URL, as printed:
    secrets redacted), the step and the attempt there, and when that attempt committed.

    Only a copy made by the tiered store's replicator has one (docs/protocol.md, "Tiers"); its
    shards' sizes and CRC32Cs are those the first write recorded.
    """

    url: str
    step: int
    attempt: str
    committed_at: datetime
    signature: Signature | None = None
    """The first write's signature, kept by the copy (the replicator never signs)."""
    signed: bytes = field(default=b"", repr=False)
    """The payload ``signature`` covers: the first write's manifest, as it was signed."""


TIER_KEY = "ckptstore.tier"
"""The metadata key of a fast-tier checkpoint saved by a tiered store: ``{"durable": URL,
"durable_epoch": E}``, the durable store (shown without credentials or query) and the epoch
of its lineage the writer was in (docs/protocol.md §9.3, T5). Reserved: a trainer's metadata
may not use it; durable copies do not carry it."""
_COPIED_FIELDS = ("name", "size", "crc32c", "block_size", "block_crc32c", "digest", "block_digests")
"""What a copy's shard records keep of the first write's (the locator is the copy's own)."""


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's complete description; publishing it is the commit point."""

    step: int
    attempt: str
    shards: tuple[ShardRecord, ...]
    writer: WriterInfo
    created_at: datetime
    committed_at: datetime
    timings: Mapping[str, float] = field(default_factory=dict)
    metadata: JSONObject = field(default_factory=dict)
    backend: str = ""
    format_version: int = FORMAT_VERSION
    epoch: int = 0
    """The lineage epoch the checkpoint was written in (docs/protocol.md §8); 0 before any
    takeover, and in manifests written before lineages (the field is then absent)."""
    source: ReplicaSource | None = None
    """Set on a replica only: where the checkpoint was first published."""
    signature: Signature | None = None
    """The writer's signature of the manifest (``ckptstore.signing``), or None: unsigned."""
    signed: bytes = field(default=b"", compare=False, repr=False)
    """The payload ``signature`` covers: set when a manifest is signed or decoded signed."""

    def signed_by(self, key: SigningKey) -> Manifest:
        """This manifest signed with ``key`` (every shard must carry a digest)."""
        unhashed = [shard.name for shard in self.shards if not shard.digest]
        if unhashed:
            raise InvalidInputError(
                f"step {self.step}: shard(s) {', '.join(unhashed[:5])} have no digest: a signed "
                f"manifest fixes every byte only through digests (open every rank's store "
                f"with the signing key, or digests=True)",
                step=self.step,
            )
        document = self.to_document()
        document.pop("signature", None)
        payload = signed_payload(FORMAT_NAME, document)
        return replace(self, signature=key.sign(payload), signed=payload)

    def _not_a_copy_of(self, payload: bytes, store_url: str) -> str | None:
        """What differs between this copy, read from ``store_url``, and the first write
        signed as ``payload``."""
        prefix = signed_payload(FORMAT_NAME, {})[: -len(b"{}")]
        if not payload.startswith(prefix):
            return "the signed payload is not a manifest"
        try:
            first = json.loads(payload[len(prefix) :].decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return "the signed manifest does not parse"
        if not isinstance(first, dict) or not isinstance(first.get("shards"), list):
            return "the signed payload is not a manifest"
        assert self.source is not None
        shards = [
            {k: v for k, v in _shard_document(s).items() if k in _COPIED_FIELDS}
            for s in self.shards
        ]
        signed = [
            {k: v for k, v in s.items() if k in _COPIED_FIELDS}
            for s in first["shards"]
            if isinstance(s, dict)
        ]
        metadata = first.get("metadata")
        tier = metadata.get(TIER_KEY) if isinstance(metadata, dict) else None
        if not isinstance(tier, dict):  # only a pair's checkpoints are copied as signed
            return "the signed manifest has no tier record: it was not saved by a tiered pair"
        epoch = tier.get("durable_epoch")
        durable = tier.get("durable")
        if not isinstance(durable, str) or shown_location(durable) != shown_location(store_url):
            return f"it was signed for the durable store {durable!r}, not this one"
        if (first.get("step"), first.get("attempt")) != (self.step, self.source.attempt) or (
            self.source.step != self.step
        ):
            return f"step {first.get('step')!r} attempt {first.get('attempt')!r} was signed"
        if first.get("committed_at") != _iso(self.source.committed_at):
            return "its first commit time is not that signed"
        if _canonical(first.get("timings")) != _canonical(dict(self.timings)):
            return "its timings are not those signed"
        if sorted(map(_canonical, shards)) != sorted(map(_canonical, signed)):
            return "its shards are not those signed"
        if not isinstance(metadata, dict) or _canonical(
            {k: v for k, v in metadata.items() if k != TIER_KEY}
        ) != _canonical(dict(self.metadata)):
            return "its metadata is not that signed"
        if type(epoch) is not int or epoch != self.epoch:
            return f"it is in epoch {self.epoch}, the first write signed durable epoch {epoch!r}"
        return None

    def check_trust(self, trust: Trust, *, where: str) -> str:
        """The id of the trusted key that signed this manifest; UntrustedCheckpointError
        if it is unsigned, signed by another key, changed since, or a shard has no digest.

        A replica (``source`` set, no signature of its own) is checked as a copy: the first
        write's signature must hold, and the copy must be of that step and attempt, with its
        shards (names, sizes, checksums, digests), its metadata, and as its epoch the durable
        epoch the first write's signed tier record names."""
        what = f"{where}: manifest of step {self.step}"
        if self.signature is None and self.source is not None and self.source.signature:
            key = trust.check(
                self.source.signature,
                self.source.signed,
                what=f"{what} (a copy of {self.source.url})",
                step=self.step,
            )
            problem = self._not_a_copy_of(self.source.signed, where)
            if problem is not None:
                raise UntrustedCheckpointError(
                    f"{what}: signed by {key} as the first write, but the copy differs from "
                    f"what was signed: {problem}",
                    reason="bad-signature",
                    step=self.step,
                )
        else:
            key = trust.check(self.signature, self.signed, what=what, step=self.step)
        for shard in self.shards:
            if not shard.digest:
                raise UntrustedCheckpointError(
                    f"{where}: step {self.step} is signed, but shard {shard.name!r} has no "
                    f"digest: its bytes are not fixed by the signature",
                    reason="no-digest",
                    step=self.step,
                    key=shard.name,
                )
        return key

    @property
    def total_size(self) -> int:
        """Sum of the shard sizes in bytes."""
        return sum(shard.size for shard in self.shards)

    def shard(self, name: str) -> ShardRecord | None:
        """Return the record of shard ``name``, or None."""
        for record in self.shards:
            if record.name == name:
                return record
        return None

    def to_document(self) -> dict[str, Any]:
        """Return the manifest as a JSON-ready dict, without its checksum."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "attempt": self.attempt,
            "backend": self.backend,
            "writer": {
                "host": self.writer.host,
                "pid": self.writer.pid,
                "world_size": self.writer.world_size,
                "rank": self.writer.rank,
            },
            "created_at": _iso(self.created_at),
            "committed_at": _iso(self.committed_at),
            "timings": dict(self.timings),
            "metadata": dict(self.metadata),
            "shards": [_shard_document(s) for s in self.shards],
            # Written only when set: manifests without it keep the document (and checksum)
            # they always had, and readers of either kind accept both.
            **({} if self.source is None else {"source": _source_document(self.source)}),
            **({"epoch": self.epoch} if self.epoch else {}),
            **({} if self.signature is None else {"signature": self.signature.to_document()}),
        }

    def encode(self) -> bytes:
        """Serialise to UTF-8 JSON with an embedded CRC32C of the canonical form."""
        document = self.to_document()
        document["checksum"] = _document_checksum(document)
        return json.dumps(document, indent=1, sort_keys=True, allow_nan=False).encode("utf-8")

    @classmethod
    def decode(
        cls,
        data: bytes,
        *,
        where: str,
        expected_step: int | None = None,
        expected_epoch: int | None = None,
    ) -> Manifest:
        """Parse and validate a stored manifest; raise ManifestCorruptError naming ``where``."""
        try:
            document = load_json(data, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH)
        except JSONDocumentError as exc:
            raise ManifestCorruptError(f"{where}: manifest {exc}") from exc
        try:
            manifest = _from_document(document, where)
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestCorruptError(f"{where}: malformed manifest: {exc!r}") from exc
        if expected_step is not None and manifest.step != expected_step:
            raise ManifestCorruptError(
                f"{where}: manifest is for step {manifest.step}, stored as step {expected_step}"
            )
        if expected_epoch is not None and manifest.epoch != expected_epoch:
            raise ManifestCorruptError(
                f"{where}: manifest is of epoch {manifest.epoch}, stored as epoch {expected_epoch}"
            )
        return manifest


def check_metadata(metadata: Mapping[str, object] | None) -> dict[str, JSONValue]:
    """Return a JSON-safe copy of trainer metadata, or raise InvalidMetadataError."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidMetadataError(f"metadata must be a mapping, got {type(metadata).__name__}")
    if _depth(metadata) > MAX_METADATA_DEPTH:
        raise InvalidMetadataError(
            f"metadata nests lists or dicts deeper than {MAX_METADATA_DEPTH} levels"
        )
    bad_key = _non_string_key(metadata)
    if bad_key is not None:
        raise InvalidMetadataError(f"metadata keys must be strings, got {bad_key}")
    try:
        text = json.dumps(dict(metadata), allow_nan=False, sort_keys=True, ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate ('\ud800') has no UTF-8 form: refused here,
        # before any shard is written, not at publish
    except UnicodeEncodeError as exc:
        raise InvalidMetadataError(
            f"metadata holds a string that is not valid Unicode (lone surrogate): {exc}"
        ) from exc
    except (TypeError, ValueError) as exc:
        raise InvalidMetadataError(
            f"metadata must be JSON (str keys; str, int, finite float, bool, None, lists, "
            f"dicts): {exc}"
        ) from exc
    if len(text) > MAX_METADATA_BYTES:
        raise InvalidMetadataError(f"metadata larger than {MAX_METADATA_BYTES} bytes of JSON")
    result: dict[str, JSONValue] = json.loads(text)
    return result


def _depth(value: object) -> int:
    """How deeply lists, tuples and mappings nest in ``value`` (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_METADATA_DEPTH:
            return deepest  # enough to refuse; a cyclic value stops here too
        stack.extend((child, level + 1) for child in children)
    return deepest


def _non_string_key(value: object) -> str | None:
    """The first dict key anywhere in ``value`` that JSON would silently turn into a string."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return repr(key)
            found = _non_string_key(item)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for item in value:
            found = _non_string_key(item)
            if found is not None:
                return found
    return None


def _document_checksum(document: Mapping[str, Any]) -> str:
    canonical = json.dumps(
        {k: v for k, v in document.items() if k != "checksum"},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return crc32c_hex(canonical.encode("utf-8"))


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: object, what: str) -> datetime:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string")
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)


def _require(document: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = document[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise TypeError(f"field {key!r} has type {type(value).__name__}")
    return value


def _from_document(document: object, where: str) -> Manifest:
    if not isinstance(document, dict):
        raise ManifestCorruptError(f"{where}: manifest is not a JSON object")
    if document.get("format") != FORMAT_NAME:
        raise ManifestCorruptError(f"{where}: not a ckptstore manifest")
    version = _require(document, "format_version", int)
    if version != FORMAT_VERSION:
        raise ManifestCorruptError(
            f"{where}: manifest format version {version} is not supported by this ckptstore "
            f"(reads version {FORMAT_VERSION}); upgrade ckptstore"
        )
    stored = document.get("checksum")
    if stored != _document_checksum(document):
        raise ManifestCorruptError(f"{where}: manifest checksum mismatch (tampered or corrupted)")
    writer = _require(document, "writer", dict)
    shards = tuple(_shard_from_document(s) for s in _require(document, "shards", list))
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise ManifestCorruptError(f"{where}: manifest lists a shard name twice")
    timings = _require(document, "timings", dict)
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in timings.values()):
        raise TypeError("timings must be finite numbers")
    try:
        step = check_step(_require(document, "step", int))
        attempt = check_attempt_id(document["attempt"])
        epoch = check_epoch(_require(document, "epoch", int)) if "epoch" in document else 0
    except ValueError as exc:
        raise ManifestCorruptError(f"{where}: {exc}") from exc
    signature = None
    if "signature" in document:
        signature = Signature.from_document(document["signature"])
    return Manifest(
        step=step,
        attempt=attempt,
        shards=shards,
        writer=WriterInfo(
            host=str(_require(writer, "host", str)),
            pid=int(_require(writer, "pid", int)),
            world_size=int(_require(writer, "world_size", int)),
            rank=int(_require(writer, "rank", int)),
        ),
        created_at=_parse_time(document["created_at"], "created_at"),
        committed_at=_parse_time(document["committed_at"], "committed_at"),
        timings={str(k): float(v) for k, v in timings.items()},
        metadata=_require(document, "metadata", dict),
        backend=str(_require(document, "backend", str)),
        format_version=version,
        epoch=epoch,
        source=_source_from_document(document["source"]) if "source" in document else None,
        signature=signature,
        signed=b"" if signature is None else signed_payload(FORMAT_NAME, document),
    )


def shown_location(url: str) -> str:
    """``url`` as a tier record names a store: without userinfo, query or fragment."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def _canonical(value: object) -> str:
    """``value`` as canonical JSON: compared as text, so 1 is never taken for true."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _source_document(source: ReplicaSource) -> dict[str, Any]:
    document: dict[str, Any] = {
        "url": source.url,
        "step": source.step,
        "attempt": source.attempt,
        "committed_at": _iso(source.committed_at),
    }
    if source.signature is not None:
        document["signature"] = source.signature.to_document()
        document["signed"] = base64.b64encode(source.signed).decode("ascii")
    return document


def _source_from_document(entry: object) -> ReplicaSource:
    if not isinstance(entry, dict):
        raise TypeError("source is not an object")
    signature, signed = None, b""
    if "signature" in entry:
        signature = Signature.from_document(entry["signature"])
        try:
            signed = base64.b64decode(_require(entry, "signed", str), validate=True)
        except binascii.Error as exc:
            raise ValueError(f"source.signed is not base64: {exc}") from exc
    return ReplicaSource(
        url=str(_require(entry, "url", str)),
        step=check_step(_require(entry, "step", int)),
        attempt=check_attempt_id(entry["attempt"]),
        committed_at=_parse_time(entry["committed_at"], "source.committed_at"),
        signature=signature,
        signed=signed,
    )


def _shard_document(record: ShardRecord) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": record.name,
        "size": record.size,
        "crc32c": record.crc32c,
        "locator": dict(record.locator),
    }
    if record.block_size:
        document["block_size"] = record.block_size
        document["block_crc32c"] = record.block_crc32c
    if record.digest:
        document["digest"] = record.digest
        document["block_digests"] = record.block_digests
    return document


def _shard_from_document(entry: object) -> ShardRecord:
    if not isinstance(entry, dict):
        raise TypeError("shard entry is not an object")
    try:
        name = check_shard_name(entry["name"], stored=True)
    except ValueError as exc:
        raise ManifestCorruptError(f"unsafe shard name in manifest: {exc}") from exc
    size = _require(entry, "size", int)
    crc = _require(entry, "crc32c", str)
    if size < 0 or len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
        raise ValueError(f"shard {name!r}: bad size or crc32c")
    locator = _require(entry, "locator", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in locator.items()):
        raise TypeError(f"shard {name!r}: locator must map strings to strings")
    block_size, blocks = 0, ""
    if "block_size" in entry:
        block_size = _require(entry, "block_size", int)
        blocks = _require(entry, "block_crc32c", str)
        expected = 8 * -(-size // block_size) if block_size > 0 else -1
        if len(blocks) != expected or any(c not in "0123456789abcdef" for c in blocks):
            raise ValueError(f"shard {name!r}: bad block_size or block_crc32c")
    digest, block_digests = "", ""
    if "digest" in entry:
        digest = _require(entry, "digest", str)
        block_digests = _require(entry, "block_digests", str)
        algorithm, _, value = digest.partition(":")
        if algorithm not in ALGORITHMS or block_size <= 0:
            raise ValueError(f"shard {name!r}: digest of unknown algorithm or without blocks")
        length = digest_length(algorithm)
        blocks_count = -(-size // block_size)
        if (
            len(value) != length
            or len(block_digests) != length * blocks_count
            or any(c not in "0123456789abcdef" for c in value + block_digests)
        ):
            raise ValueError(f"shard {name!r}: bad digest or block_digests")
    return ShardRecord(
        name=name,
        size=size,
        crc32c=crc,
        locator=dict(locator),
        block_size=block_size,
        block_crc32c=blocks,
        digest=digest,
        block_digests=block_digests,
    )
