"""Cryptographic digests of shards, block by block: a shard's bytes cannot be changed unseen.

A CRC32C finds damage; anyone can recompute it for bytes of their choosing. A manifest may
therefore also record, per shard, a cryptographic digest of each ``BLOCK_SIZE`` piece (the
pieces that carry a CRC32C of their own, so a ranged read checks what it reads) and a digest
of the shard: the digest of its algorithm's name, its size and its blocks' digests in order.
Changing any byte changes its block's digest, and so the shard's; a signed manifest
(``ckptstore.signing``) therefore fixes every byte of every shard.

Algorithms: ``blake3`` (the ``blake3`` package; fastest, the default where installed) and
``sha256`` (hashlib, always there). Both hash large buffers without holding the GIL, so a
block is hashed on another thread while the next one is read or written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

from ckptstore.checksum import BLOCK_SIZE
from ckptstore.errors import InvalidOptionError

__all__ = [
    "ALGORITHMS",
    "BlockDigests",
    "block_hexdigest",
    "default_algorithm",
    "digest_length",
    "hasher",
    "shard_digest",
]


class _Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def _blake3() -> Callable[[], _Hasher] | None:
    try:
        from blake3 import blake3
    except ImportError:
        return None
    return blake3


_FACTORIES: dict[str, Callable[[], _Hasher]] = {"sha256": hashlib.sha256}
_blake3_factory = _blake3()
if _blake3_factory is not None:
    _FACTORIES["blake3"] = _blake3_factory

ALGORITHMS = ("blake3", "sha256")
"""Every algorithm a manifest may name; a reader without ``blake3`` installed cannot check
a blake3 digest and says so (``hasher``)."""
_HEX_LENGTH = {"blake3": 64, "sha256": 64}
_SHARD_DOMAIN = b"ckptstore.shard-digest.v1\0"


def default_algorithm() -> str:
    """``blake3`` where the package is installed, else ``sha256``."""
    return "blake3" if "blake3" in _FACTORIES else "sha256"


def check_algorithm(name: object) -> str:
    """``name`` if it is an algorithm this process can compute, else InvalidOptionError."""
    if name not in ALGORITHMS:
        raise InvalidOptionError(
            f"digest algorithm must be one of {', '.join(ALGORITHMS)}, got {name!r}"
        )
    assert isinstance(name, str)
    if name not in _FACTORIES:
        raise InvalidOptionError(
            f"digest algorithm {name!r} needs the blake3 package: pip install "
            f"'ckptstore[trust]' (or use sha256)"
        )
    return name


def digest_length(algorithm: str) -> int:
    """Hex digits in one digest of ``algorithm``."""
    return _HEX_LENGTH[algorithm]


def hasher(algorithm: str) -> _Hasher:
    """A fresh hash object of ``algorithm`` (InvalidOptionError if it cannot be computed)."""
    return _FACTORIES[check_algorithm(algorithm)]()


def block_hexdigest(algorithm: str, data: bytes | bytearray | memoryview) -> str:
    """The digest of one block's bytes, in hex."""
    digest = hasher(algorithm)
    digest.update(data)
    return digest.hexdigest()


def shard_digest(algorithm: str, size: int, block_hexdigests: str) -> str:
    """The shard's digest: of the algorithm's name, the size and the block digests in order
    (so it is computed from the blocks', with no second pass over the bytes)."""
    digest = hasher(algorithm)
    digest.update(_SHARD_DOMAIN + algorithm.encode() + b"\0" + str(size).encode() + b"\0")
    digest.update(bytes.fromhex(block_hexdigests))
    return digest.hexdigest()


class BlockDigests:
    """The digest of each ``block_size`` piece of a stream, and of the whole, in one pass.

    ``update`` takes the stream in pieces of any size; a block's digest is final when its
    last byte arrives. ``expected`` (the block digests a manifest recorded) makes each block
    checked as it completes: ``mismatch`` then names the first block that differed.
    """

    __slots__ = (
        "_current",
        "_done",
        "_filled",
        "_index",
        "algorithm",
        "block_size",
        "expected",
        "mismatch",
        "size",
    )

    def __init__(
        self,
        algorithm: str,
        block_size: int = BLOCK_SIZE,
        *,
        expected: str | None = None,
        first_block: int = 0,
    ) -> None:
        """``first_block``: the index of the block the stream starts at (a ranged read)."""
        if block_size < 1:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.algorithm = check_algorithm(algorithm)
        self.block_size = block_size
        self.expected = expected
        self.mismatch: str | None = None
        self.size = 0
        self._current = hasher(algorithm)
        self._filled = 0
        self._index = first_block
        self._done: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Fold ``data`` into the digests (and check each block it completes)."""
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        offset = 0
        while offset < view.nbytes:
            piece = view[offset : offset + self.block_size - self._filled]
            self._current.update(piece)
            self._filled += piece.nbytes
            offset += piece.nbytes
            if self._filled == self.block_size:
                self._close_block()
        self.size += view.nbytes

    def _close_block(self) -> None:
        value = self._current.hexdigest()
        if self.expected is not None and self.mismatch is None:
            length = _HEX_LENGTH[self.algorithm]
            want = self.expected[length * self._index : length * (self._index + 1)]
            if value != want:
                first = self._index * self.block_size
                self.mismatch = (
                    f"{self.algorithm} digest mismatch in block {self._index} (bytes "
                    f"{first}..{first + self._filled})"
                )
        self._done.append(value)
        self._index += 1
        self._current = hasher(self.algorithm)
        self._filled = 0

    def finish(self) -> None:
        """Close the last, short block (if any): call once the stream has ended."""
        if self._filled:
            self._close_block()

    def block_hexdigests(self) -> str:
        """Every closed block's digest, in order (``finish`` closes the last one)."""
        return "".join(self._done)

    def hexdigest(self) -> str:
        """The shard digest of the blocks closed so far (after ``finish``: of the stream)."""
        return shard_digest(self.algorithm, self.size, self.block_hexdigests())
