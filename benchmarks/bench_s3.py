"""S3 save and load through ckptstore against boto3's tuned transfers, on SeaweedFS.

    python benchmarks/bench_s3.py [--size 1G] [--repeats 3]

Starts SeaweedFS on 127.0.0.1. Baseline: boto3 ``upload_fileobj`` / ``download_fileobj`` with
TransferConfig(16 MiB chunks, 8 threads) of the same four shards.
"""

from __future__ import annotations

import argparse
import io

import torch
from boto3.s3.transfer import TransferConfig

import ckptstore
from ckptstore.tools.embedded import embedded_seaweedfs
from ckptstore.tools.timing import measure, print_table, sizes

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = sizes([args.size])[0]
    shards = {f"model/rank{i}.bin": torch.randn(total // 4 // 4).numpy() for i in range(4)}
    size = sum(a.nbytes for a in shards.values())
    config = TransferConfig(multipart_chunksize=16 * MiB, max_concurrency=8)
    with embedded_seaweedfs() as server:
        client = server.client()
        url = server.url("bench", part_size=16 * MiB, concurrency=8)
        store = ckptstore.open(url, **server.options)

        def ckpt_save(repeat: int) -> None:
            with store.begin(repeat + 1) as pending:
                for name, array in shards.items():
                    pending.write(name, array)

        def boto_save(repeat: int) -> None:
            for name, array in shards.items():
                body = io.BytesIO(memoryview(array).cast("B"))
                client.upload_fileobj(body, server.bucket, f"raw/{repeat}/{name}", Config=config)

        saved = measure({"boto3 transfer": boto_save, "ckptstore": ckpt_save}, args.repeats)
        print_table(f"S3 save, {size / 2**30:.2f} GiB in 4 shards", saved, "boto3 transfer", size)

        buffers = {name: bytearray(array.nbytes) for name, array in shards.items()}

        def ckpt_load(repeat: int) -> None:
            checkpoint = store.get(repeat + 1)
            for name, buffer in buffers.items():
                checkpoint.read_into(name, buffer)

        def boto_load(repeat: int) -> None:
            for name in shards:
                sink = io.BytesIO()
                client.download_fileobj(server.bucket, f"raw/{repeat}/{name}", sink, Config=config)

        loaded = measure({"boto3 transfer": boto_load, "ckptstore": ckpt_load}, args.repeats)
        print_table(f"S3 load, {size / 2**30:.2f} GiB", loaded, "boto3 transfer", size)


if __name__ == "__main__":
    main()
