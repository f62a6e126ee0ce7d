"""The canary of ``checksum.native_extend``: google-crc32c's C function, called through ctypes
on a buffer's own memory, exists in the installed release and agrees with the public API.

If a google-crc32c release drops or changes it, this test fails (ckptstore itself still works:
it falls back to copying each buffer through the public API); then pin pyproject's range below
that release, or move to a public zero-copy API.
"""

from __future__ import annotations

import array
import os

import google_crc32c
import pytest

from ckptstore import checksum
from ckptstore.checksum import BlockCrc32c, Crc32c, crc32c_of


def test_the_native_function_is_there_and_used() -> None:
    assert checksum.native_extend() is not None, (
        f"google-crc32c {google_crc32c.__file__} has no native crc32c_extend: ckptstore copies "
        f"every buffer it checksums; pin the range in pyproject.toml below this release"
    )
    assert checksum._native_extend is not None


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 1_000_003])
def test_the_native_function_agrees_with_the_public_api(size: int) -> None:
    data = os.urandom(size)
    expected = google_crc32c.value(data)
    writable = bytearray(data)
    assert crc32c_of(writable) == expected  # the native path: a writable buffer
    assert crc32c_of(memoryview(writable)) == expected
    assert crc32c_of(data) == expected  # the public API: bytes
    assert crc32c_of(memoryview(data)) == expected  # read-only: copied through the public API
    if size % 4 == 0 and size:
        floats = array.array("f", data)  # a typed buffer, cast to bytes on the way
        assert crc32c_of(memoryview(floats)) == expected


def test_running_and_block_checksums_match_the_whole_buffers() -> None:
    data = bytearray(os.urandom(3 * 1024 * 1024 + 17))
    running, blocks = Crc32c(), BlockCrc32c(block_size=1024 * 1024)
    for start in range(0, len(data), 100_003):
        piece = memoryview(data)[start : start + 100_003]
        running.update(piece)
        blocks.update(piece)
    assert running.hexdigest() == blocks.hexdigest() == f"{google_crc32c.value(bytes(data)):08x}"
    expected_blocks = "".join(
        f"{google_crc32c.value(bytes(data[i : i + 1024 * 1024])):08x}"
        for i in range(0, len(data), 1024 * 1024)
    )
    assert blocks.block_hexdigests() == expected_blocks
