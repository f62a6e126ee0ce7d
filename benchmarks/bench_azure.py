"""Azure Blob save and load through ckptstore against the SDK's parallel transfers, on Azurite.

    python -m benchmarks.bench_azure [--size 512M] [--repeats 3] [--shards 1,4]

Starts Azurite on 127.0.0.1. Baseline: azure-storage-blob ``upload_blob`` / ``download_blob``
with ``max_concurrency=8`` and 8 MiB blocks and ranges (the same sizes ckptstore uses), of the
same bytes: one large shard, then the same total in several shards. Loads are also compared
with the SDK reading the very blobs ckptstore stored (its own uploads store a shard of up to
64 MiB as one Put Blob, which Azurite serves faster than committed blocks).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import ckptstore
from ckptstore.tools.embedded_azure import embedded_azurite
from ckptstore.tools.timing import measure, print_table, sizes

MiB = 2**20
CONCURRENCY = 8
BLOCK = 8 * MiB


class _Into:
    """A seekable, writable view of a preallocated buffer: the SDK's parallel download writes
    its ranges straight in, as ckptstore's ``read_into`` does (no growing BytesIO)."""

    def __init__(self, buffer: bytearray) -> None:
        self._view = memoryview(buffer)
        self._position = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        self._position = position if whence == os.SEEK_SET else self._position + position
        return self._position

    def tell(self) -> int:
        return self._position

    def write(self, data: Any) -> int:
        count = len(data)
        self._view[self._position : self._position + count] = data
        self._position += count
        return count


def _run(server: Any, total: int, count: int, repeats: int) -> None:
    block = os.urandom(16 * MiB)
    per = total // count
    shards = {f"model/rank{i}.bin": (block * (per // len(block) + 1))[:per] for i in range(count)}
    size = per * count
    prefix = f"bench-{count}"
    store = ckptstore.open(
        server.url(prefix, part_size=BLOCK, concurrency=CONCURRENCY), **server.options
    )
    service = server.client(max_block_size=BLOCK, max_single_get_size=BLOCK,
                            max_chunk_get_size=BLOCK)  # fmt: skip
    container = service.get_container_client(server.container)

    def ckpt_save(repeat: int) -> None:
        with store.begin(repeat + 1) as pending:
            for name, blob in shards.items():
                pending.write(name, blob)

    def sdk_save(repeat: int) -> None:
        for name, blob in shards.items():
            container.upload_blob(f"raw/{count}/{repeat}/{name}", blob, overwrite=True,
                                  max_concurrency=CONCURRENCY)  # fmt: skip

    what = f"{size / MiB:.0f} MiB in {count} shard{'s' if count > 1 else ''}"
    saved = measure({"SDK transfer": sdk_save, "ckptstore": ckpt_save}, repeats)
    print_table(f"Azure save, {what}", saved, "SDK transfer", size)

    buffers = {name: bytearray(per) for name in shards}

    def ckpt_load(repeat: int) -> None:
        checkpoint = store.get(repeat + 1)
        for name, buffer in buffers.items():
            checkpoint.read_into(name, buffer)

    def sdk_load(repeat: int) -> None:
        for name, buffer in buffers.items():
            downloader = container.download_blob(
                f"raw/{count}/{repeat}/{name}", max_concurrency=CONCURRENCY
            )
            downloader.readinto(_Into(buffer))

    # The same blobs ckptstore stored, read by the SDK: the SDK's own upload stores a shard
    # up to 64 MiB with one Put Blob (max_single_put_size), which Azurite serves about twice
    # as fast as the staged blocks ckptstore commits; reading the same blobs compares the
    # readers alone.
    stored = {
        step: [f"{prefix}/{r.locator['key']}" for r in store.get(step).manifest.shards]
        for step in store.steps()
    }

    def sdk_load_same(repeat: int) -> None:
        for blob_name, buffer in zip(stored[repeat + 1], buffers.values(), strict=True):
            downloader = container.download_blob(blob_name, max_concurrency=CONCURRENCY)
            downloader.readinto(_Into(buffer))

    loaded = measure(
        {"SDK transfer": sdk_load, "SDK, ckptstore's blobs": sdk_load_same,
         "ckptstore": ckpt_load},
        repeats,
    )  # fmt: skip
    print_table(f"Azure load, {what}", loaded, "SDK transfer", size)
    print_table(f"Azure load, {what}", loaded, "SDK, ckptstore's blobs", size)
    for blob in list(container.list_blobs(name_starts_with=f"raw/{count}/")):
        container.delete_blob(blob.name)
    for step in store.steps():
        store.delete(step, force=True)
    service.close()
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", default="1,4", help="shard counts to measure, in turn")
    args = parser.parse_args()
    total = sizes([args.size])[0]
    with embedded_azurite() as server:
        for count in (int(c) for c in args.shards.split(",")):
            _run(server, total, count, args.repeats)


if __name__ == "__main__":
    main()
