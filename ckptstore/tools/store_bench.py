"""``ckptstore bench URL``: save and load through ckptstore against the raw baseline of the
same storage, side by side (file systems: a plain write + fsync and read of the same bytes;
S3: boto3's tuned transfers, 16 MiB chunks and 8 threads)."""

from __future__ import annotations

import io
import os
import secrets
import shutil
from collections.abc import Callable
from typing import Any, TextIO

from ckptstore.backends.posix import PosixDriver
from ckptstore.backends.s3 import S3Driver
from ckptstore.conformance.location import child_url
from ckptstore.errors import InvalidInputError
from ckptstore.store import open_store
from ckptstore.tools.timing import busy, evict, layout, measure, print_table

__all__ = ["run_bench"]

MiB = 2**20


def run_bench(url: str, size: int, repeats: int, out: TextIO, *, busy_processes: int = 0) -> int:
    """Benchmark the store at ``url`` with ``size`` bytes in 8 shards; print the tables.

    ``busy_processes`` CPU-bound processes run beside the measurement (a training node is
    never idle: data-loader workers, other ranks)."""
    run = f"ckptstore-bench-{secrets.token_hex(4)}"
    store = open_store(child_url(url, run))
    driver: Any = store.strategy.driver
    per = max(1, size // 8)
    block = os.urandom(min(per, 16 * MiB))
    shards = {f"shard{i}.bin": block * max(1, per // len(block)) for i in range(8)}
    total = sum(len(blob) for blob in shards.values())
    write_line: Callable[[str], object] = lambda text: out.write(text + "\n")  # noqa: E731

    def ckpt_save(repeat: int) -> None:
        with store.begin(repeat + 1) as pending:
            for name, blob in shards.items():
                pending.write(name, blob)

    buffers = {name: bytearray(len(blob)) for name, blob in shards.items()}

    def ckpt_load(repeat: int) -> None:
        checkpoint = store.get(repeat + 1)
        for name, buffer in buffers.items():
            checkpoint.read_into(name, buffer)

    if isinstance(driver, PosixDriver):
        raw_dir = os.path.join(driver.root, "raw")
        os.makedirs(raw_dir, exist_ok=True)

        def raw_save(repeat: int) -> None:
            for name, blob in shards.items():
                fd = os.open(f"{raw_dir}/{repeat}-{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                try:
                    view = memoryview(blob)
                    while view:
                        view = view[os.write(fd, view[: 64 * MiB]) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)

        def raw_load(repeat: int) -> None:
            for name, buffer in buffers.items():
                with open(f"{raw_dir}/{repeat}-{name}", "rb", buffering=0) as handle:
                    handle.readinto(buffer)

        def cleanup() -> None:
            shutil.rmtree(driver.root, ignore_errors=True)

        def drop_caches(name: str, repeat: int) -> None:
            evict(driver.root)

        baseline = "raw write+fsync / read"
        drop: Callable[[str, int], object] | None = drop_caches
    elif isinstance(driver, S3Driver):
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_chunksize=16 * MiB, max_concurrency=8)
        raw_key = f"{driver.prefix}raw"

        def raw_save(repeat: int) -> None:
            for name, blob in shards.items():
                key = f"{raw_key}/{repeat}-{name}"
                driver.client.upload_fileobj(io.BytesIO(blob), driver.bucket, key, Config=config)

        def raw_load(repeat: int) -> None:
            for name in shards:
                key = f"{raw_key}/{repeat}-{name}"
                driver.client.download_fileobj(driver.bucket, key, io.BytesIO(), Config=config)

        def cleanup() -> None:
            for info in list(driver.list("")):
                driver.delete(info.key)

        baseline, drop = "boto3 transfer", None
    else:
        raise InvalidInputError(f"{url}: ckptstore bench measures file systems and S3")
    try:
        with busy(busy_processes):
            saved = measure({baseline: raw_save, "ckptstore": ckpt_save}, repeats)
            loaded = measure({baseline: raw_load, "ckptstore": ckpt_load}, repeats, before=drop)
        for what, results in (("save", saved), ("load", loaded)):
            print_table(
                f"{what}, {total / MiB:.0f} MiB",
                results,
                baseline,
                total,
                write_line,
                layout=layout(len(shards), len(block) * max(1, per // len(block))),
                busy=busy_processes,
            )
    finally:
        cleanup()
    return 0
