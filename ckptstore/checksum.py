"""CRC32C of streamed bytes, computed without copying the caller's buffers where possible.

``google-crc32c``'s Python entry points accept only ``bytes``; checksumming a numpy array or a
memoryview through them would copy every byte once more. The hardware-accelerated function of
the same library is therefore also called through ctypes on the buffer's own memory (ctypes
releases the GIL during the call, so a background save does not stall the trainer).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import google_crc32c
from google_crc32c import _crc32c as _crc32c_ext

__all__ = ["Crc32c", "crc32c_hex", "crc32c_of"]

_ExtendFn = Callable[[int, object, int], int]


def _load_native_extend() -> _ExtendFn | None:
    try:
        lib = ctypes.CDLL(_crc32c_ext.__file__)
        fn = lib.crc32c_extend
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_uint32
    return fn


_native_extend = _load_native_extend()


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
