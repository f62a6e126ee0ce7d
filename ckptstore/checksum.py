"""CRC32C of streamed bytes, computed without copying the caller's buffers where possible.

``google-crc32c``'s Python entry points accept only ``bytes`` (not a memoryview, a bytearray or
a numpy array): checksumming a tensor's memory through them copies every byte once more. The
library's C function is therefore also called through ctypes on the buffer's own memory (and
ctypes releases the GIL during the call, so a background save does not stall the trainer).
That reaches into the package's private extension module, so it lives in one function,
``native_extend``; ``tests/test_checksum_native.py`` fails loudly on a google-crc32c release
that no longer has it (pyproject pins the range tested), and ckptstore then falls back to the
public API (a copy per buffer, same result). ``benchmarks/bench_crc32c.py`` measures the gain.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import google_crc32c

__all__ = [
    "BLOCK_SIZE",
    "BlockCrc32c",
    "Crc32c",
    "crc32c_combine",
    "crc32c_hex",
    "crc32c_of",
    "native_extend",
]

log = logging.getLogger(__name__)

BLOCK_SIZE = 4 * 1024 * 1024
"""The piece of a shard that carries a CRC32C of its own in the manifest: a read of part of a
shard reads and checks the blocks it touches, not the whole shard."""

_ExtendFn = Callable[[int, object, int], int]


def native_extend() -> _ExtendFn | None:
    """google-crc32c's C ``crc32c_extend(crc, pointer, length)``, or None where this release
    of the package does not expose it (then every non-``bytes`` buffer is copied once).

    The one place ckptstore reaches into the package's private ``_crc32c`` extension."""
    try:
        from google_crc32c import _crc32c

        lib = ctypes.CDLL(_crc32c.__file__)
        fn = lib.crc32c_extend
    except (ImportError, OSError, AttributeError) as exc:
        log.info("google-crc32c without a native crc32c_extend (%s): buffers are copied", exc)
        return None
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_uint32
    return fn


_native_extend = native_extend()


def _extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    if isinstance(data, bytes):
        return int(google_crc32c.extend(crc, data))
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.nbytes == 0:
        return crc
    if _native_extend is not None and not view.readonly and view.c_contiguous:
        flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        buffer = (ctypes.c_char * flat.nbytes).from_buffer(flat)
        return int(_native_extend(crc, ctypes.addressof(buffer), flat.nbytes))
    return int(google_crc32c.extend(crc, view.tobytes()))


class Crc32c:
    """A running CRC32C (Castagnoli) with its byte count, updated chunk by chunk."""

    __slots__ = ("size", "value")

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Fold ``data`` into the checksum and the size."""
        self.value = _extend(self.value, data)
        self.size += data.nbytes if isinstance(data, memoryview) else len(data)

    def hexdigest(self) -> str:
        """Return the checksum as 8 lowercase hex digits, as manifests record it."""
        return f"{self.value:08x}"


def crc32c_of(data: bytes | bytearray | memoryview) -> int:
    """Return the CRC32C of ``data`` as an int."""
    return _extend(0, data)


def crc32c_hex(data: bytes | bytearray | memoryview) -> str:
    """Return the CRC32C of ``data`` as 8 lowercase hex digits."""
    return f"{crc32c_of(data):08x}"


# -- combining CRCs ------------------------------------------------------------------------
# CRC32C is linear over GF(2): the CRC of A+B is (the CRC of A, carried through len(B) zero
# bytes) XOR (the CRC of B). Carrying through n zero bytes is a 32x32 bit matrix, the product
# of the matrices for the powers of two in n (as zlib's crc32_combine does, here cached).

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected
_Matrix = tuple[int, ...]  # column n: the image of bit n


def _times(matrix: _Matrix, vector: int) -> int:
    result, bit = 0, 0
    while vector:
        if vector & 1:
            result ^= matrix[bit]
        vector >>= 1
        bit += 1
    return result


def _square(matrix: _Matrix) -> _Matrix:
    return tuple(_times(matrix, column) for column in matrix)


def _zero_byte_powers() -> list[_Matrix]:
    """The matrices for 1, 2, 4, ... 2**63 zero bytes."""
    one_bit: _Matrix = (_POLY, *(1 << n for n in range(31)))
    power = _square(_square(_square(one_bit)))  # 8 zero bits: one zero byte
    powers = [power]
    for _ in range(63):
        power = _square(power)
        powers.append(power)
    return powers


_POWERS: list[_Matrix] = []


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """The CRC32C of A+B from the CRC32C of A, that of B, and B's length in bytes."""
    if not _POWERS:
        _POWERS.extend(_zero_byte_powers())
    bit = 0
    while second_length:
        if second_length & 1:
            first = _times(_POWERS[bit], first)
        second_length >>= 1
        bit += 1
    return first ^ second


class BlockCrc32c:
    """The CRC32C of a stream and of each ``block_size`` piece of it, in one pass over the bytes.

    Each byte is checksummed once, into its block's CRC; the whole stream's CRC is combined from
    the blocks' (``crc32c_combine``), so block checksums cost no second pass.
    """

    __slots__ = ("_block", "_blocks", "_whole", "block_size", "size")

    def __init__(self, block_size: int | None = None) -> None:
        block_size = BLOCK_SIZE if block_size is None else block_size
        if block_size < 1:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.block_size = block_size
        self.size = 0
        self._whole = 0
        self._block = Crc32c()
        self._blocks: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Fold ``data`` into the checksums."""
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        offset = 0
        while offset < view.nbytes:
            piece = view[offset : offset + self.block_size - self._block.size]
            self._block.update(piece)
            offset += piece.nbytes
            if self._block.size == self.block_size:
                self._close_block()
        self.size += view.nbytes

    def _close_block(self) -> None:
        block = self._block
        self._whole = crc32c_combine(self._whole, block.value, block.size)
        self._blocks.append(block.hexdigest())
        self._block = Crc32c()

    def hexdigest(self) -> str:
        """The whole stream's CRC32C, 8 lowercase hex digits."""
        whole = self._whole
        if self._block.size:
            whole = crc32c_combine(whole, self._block.value, self._block.size)
        return f"{whole:08x}"

    def block_hexdigests(self) -> str:
        """Every block's CRC32C, 8 hex digits each, in order (the last block may be short)."""
        tail = [self._block.hexdigest()] if self._block.size else []
        return "".join([*self._blocks, *tail])
