"""CRC32C of a tensor's memory: ckptstore's zero-copy call against google-crc32c's public API.

    python benchmarks/bench_crc32c.py [--size 512M] [--repeats 7]

Baseline: ``google_crc32c.extend(0, bytes(view))``, the public API, which takes only ``bytes``
and so copies the buffer first. Contender: ``ckptstore.checksum.crc32c_of(view)``, which calls
the library's C function through ctypes on the buffer itself (``checksum.native_extend``).
The gain is what justifies reaching into the package's private extension module.
"""

from __future__ import annotations

import argparse
import os

import google_crc32c

from ckptstore.checksum import crc32c_of, native_extend
from ckptstore.tools.timing import measure, print_table, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="512M")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    [size] = sizes([args.size])
    if native_extend() is None:
        raise SystemExit("this google-crc32c has no native crc32c_extend: nothing to compare")
    buffer = bytearray(os.urandom(1024 * 1024)) * (size // (1024 * 1024))
    view = memoryview(buffer)
    expected = google_crc32c.value(bytes(buffer))
    assert crc32c_of(view) == expected

    def public(_: int) -> None:
        google_crc32c.extend(0, bytes(view))

    def zero_copy(_: int) -> None:
        crc32c_of(view)

    results = measure(
        {"google_crc32c.extend(bytes(view))": public, "ckptstore crc32c_of(view)": zero_copy},
        args.repeats,
    )
    print_table(
        f"CRC32C of {len(buffer) >> 20} MiB, {args.repeats} repeats",
        results,
        baseline="google_crc32c.extend(bytes(view))",
        size_bytes=len(buffer),
    )


if __name__ == "__main__":
    main()
