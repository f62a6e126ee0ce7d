"""Load of one large shard from S3: ckptstore against boto3's ``download_fileobj`` and obstore.

    python -m benchmarks.bench_s3_load [--size 1G] [--repeats 5] [--concurrency 8]

Starts SeaweedFS on 127.0.0.1 and saves one shard of ``--size`` through ckptstore; every
contender then reads that same object, interleaved (the order rotates every repeat):

- ``boto3 download_fileobj`` (the baseline): TransferConfig(16 MiB chunks, ``--concurrency``
  threads) into a ``BytesIO``, as most code calls it;
- ``boto3 download_fileobj, preallocated``: the same into a preallocated buffer (no growing);
- ``ckptstore read_into``: ranged GETs in parallel into the destination, each block checked
  against its CRC32C as its range lands (``read_concurrency``/``read_range_size`` defaults);
- ``ckptstore, two streams``: the path drivers without ``read_range`` take (the shard read as
  two halves, each from one GET);
- ``obstore get`` (one streamed GET) and ``obstore get_range x N`` (``--concurrency`` threads
  of 16 MiB ranges), each into the preallocated buffer, no checksum; and ``ckptstore read_into,
  ranges through obstore``: ckptstore's parallel read with the driver's ``read_range`` done by
  obstore (GET Range If-Match, streamed into the destination): what switching the data path
  to obstore would give. Skipped without obstore.

Prints medians and ratios, and each contender's client CPU time per GiB (on a shared machine
the CPU a reader needs matters as much as its time); never fails on a time.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from boto3.s3.transfer import TransferConfig

import ckptstore
from ckptstore.backends.s3 import S3Driver
from ckptstore.checkpoint import Checkpoint
from ckptstore.driver import ObjectInfo
from ckptstore.tools.embedded import EmbeddedS3, embedded_seaweedfs
from ckptstore.tools.timing import measure, print_table, sizes

MiB = 2**20
RANGE = 16 * MiB


class _Preallocated(io.RawIOBase):
    """A seekable file over a preallocated buffer: what download_fileobj writes into."""

    def __init__(self, buffer: bytearray) -> None:
        super().__init__()
        self._view = memoryview(buffer)
        self._position = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        self._position = position if whence == io.SEEK_SET else self._position + position
        return self._position

    def tell(self) -> int:
        return self._position

    def write(self, data: Any) -> int:
        count = memoryview(data).nbytes
        self._view[self._position : self._position + count] = data
        self._position += count
        return count


def _obstore_contenders(
    server: EmbeddedS3,
    key: str,
    buffer: bytearray,
    concurrency: int,
    via: tuple[Checkpoint, S3Driver],
) -> dict[str, Callable[[int], object]]:
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        print("obstore is not installed: its contenders are skipped (pip install obstore)\n")
        return {}
    store = S3Store(
        server.bucket,
        endpoint=server.endpoint_url,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        region="us-east-1",
        client_options={"allow_http": True},
    )
    size = len(buffer)
    view = memoryview(buffer)

    def streamed(repeat: int) -> None:
        position = 0
        for chunk in obstore.get(store, key):
            count = len(chunk)
            view[position : position + count] = chunk
            position += count

    def ranged(repeat: int) -> None:
        def one(start: int) -> None:
            end = min(start + RANGE, size)
            view[start:end] = memoryview(obstore.get_range(store, key, start=start, end=end))

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(0, size, RANGE)))

    def read_range(
        key: str,
        offset: int,
        into: Any,
        *,
        version_id: str | None = None,
        if_match: str | None = None,
    ) -> ObjectInfo:
        """The driver call, through obstore: a GET Range If-Match streamed into ``into``."""
        view = memoryview(into).cast("B")
        options: dict[str, Any] = {"range": (offset, offset + view.nbytes)}
        if if_match:
            options["if_match"] = if_match
        if version_id:
            options["version"] = version_id
        result = obstore.get(store, driver._full(key), options=options)
        position = 0
        for chunk in result.stream(min_chunk_size=1024 * 1024):
            count = len(chunk)
            view[position : position + count] = chunk
            position += count
        if position != view.nbytes:
            raise OSError(f"short range: {position} of {view.nbytes}")
        return ObjectInfo(key, result.meta["size"], str(result.meta["e_tag"]), 0.0)

    checkpoint, driver = via

    def through_obstore(repeat: int) -> None:
        driver.read_range = read_range  # type: ignore[method-assign]
        try:
            checkpoint.read_into("shard", buffer)
        finally:
            del driver.read_range

    return {
        "obstore get": streamed,
        f"obstore get_range x{concurrency}": ranged,
        "ckptstore read_into, ranges through obstore": through_obstore,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    size = sizes([args.size])[0]
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    config = TransferConfig(multipart_chunksize=16 * MiB, max_concurrency=args.concurrency)
    with embedded_seaweedfs() as server:
        client = server.client()
        store = ckptstore.open(
            server.url("bench", part_size=16 * MiB, concurrency=args.concurrency),
            **server.options,
        )
        store.save(1, {"shard": data})
        del data
        checkpoint = store.get(1)
        driver = store.strategy.driver
        assert isinstance(driver, S3Driver)
        key = driver._full(checkpoint.shards["shard"].locator["key"])
        buffer = bytearray(size)
        two_streams = store.get(1)
        two_streams._ranges = None  # as a driver without read_range is read

        def boto_bytesio(repeat: int) -> None:
            client.download_fileobj(server.bucket, key, io.BytesIO(), Config=config)

        def boto_preallocated(repeat: int) -> None:
            client.download_fileobj(server.bucket, key, _Preallocated(buffer), Config=config)

        contenders: dict[str, Callable[[int], object]] = {
            "boto3 download_fileobj": boto_bytesio,
            "boto3 download_fileobj, preallocated": boto_preallocated,
            "ckptstore read_into": lambda repeat: checkpoint.read_into("shard", buffer),
            "ckptstore, two streams": lambda repeat: two_streams.read_into("shard", buffer),
            **_obstore_contenders(server, key, buffer, args.concurrency, (checkpoint, driver)),
        }
        cpu: dict[str, list[float]] = {name: [] for name in contenders}
        started: list[float] = []

        def before(name: str, repeat: int) -> None:
            started[:] = [_cpu_seconds()]

        def after(name: str, repeat: int) -> None:
            cpu[name].append(_cpu_seconds() - started[0])

        results = measure(contenders, args.repeats, before=before, after=after)
        print_table(
            f"S3 load of one {size / 2**30:.2f} GiB shard (SeaweedFS, {args.repeats} repeats, "
            f"load average {os.getloadavg()[0]:.1f} at the end)",
            results,
            "boto3 download_fileobj",
            size,
        )
        print("| contender | client CPU per GiB (median) |\n| --- | --- |")
        for name, seconds in cpu.items():
            print(f"| {name} | {statistics.median(seconds) / (size / 2**30):.2f} s |")
        print("\n(user + system time of this process, all its threads; the server's excluded)")


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
