"""GCS save and load through ckptstore against google-cloud-storage's own transfers, on
fake-gcs-server.

    python -m benchmarks.bench_gcs [--size 256M] [--repeats 3]

Starts fake-gcs-server on 127.0.0.1 (in memory). Two layouts of ``--size`` bytes: one shard,
and four. Baselines, the SDK's best on this emulator: saves with ``Blob.upload_from_file`` per
shard, and ``transfer_manager.upload_many`` (the shards in 8 threads); loads with
``Blob.download_to_file`` per shard and ``transfer_manager.download_chunks_concurrently``
(8 threads, 16 MiB ranges; ``upload_chunks_concurrently`` needs the XML API, which
fake-gcs-server does not serve). ckptstore: composite uploads of 8 MiB parts, 8 at once, and
generation-pinned ranged reads, 8 at once; and with one part per shard (no compose: each
shard one upload, as the SDK's).
"""

from __future__ import annotations

import argparse
import io
import os

from google.cloud.storage import transfer_manager

import ckptstore
from ckptstore.tools.embedded_gcs import embedded_fake_gcs
from ckptstore.tools.timing import measure, print_table, sizes

MiB = 2**20
WORKERS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256M")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = sizes([args.size])[0]
    with embedded_fake_gcs() as server:
        for count in (1, 4):
            shards = {f"model/rank{i}.bin": os.urandom(total // count) for i in range(count)}
            _run(server, shards, args.repeats)


def _run(server: object, shards: dict[str, bytes], repeats: int) -> None:
    from ckptstore.tools.embedded_gcs import EmbeddedGCS

    assert isinstance(server, EmbeddedGCS)
    size = sum(len(data) for data in shards.values())
    client = server.client()
    bucket = client.bucket(server.bucket)
    url = server.url(f"bench-{len(shards)}", part_size=8 * MiB, concurrency=WORKERS)
    store = ckptstore.open(url, **server.options)
    layout = f"{size / 2**20:.0f} MiB in {len(shards)} shard{'s' if len(shards) > 1 else ''}"

    def ckpt_save(repeat: int) -> None:
        with store.begin(repeat + 1) as pending:
            for name, data in shards.items():
                pending.write(name, data)

    largest = max(len(data) for data in shards.values())
    whole_url = server.url(f"bench-whole-{len(shards)}", part_size=largest, concurrency=WORKERS)
    whole = ckptstore.open(whole_url, **server.options)

    def ckpt_save_whole(repeat: int) -> None:
        with whole.begin(repeat + 1) as pending:  # each shard one upload: no compose
            for name, data in shards.items():
                pending.write(name, data)

    def sdk_upload(repeat: int) -> None:
        for name, data in shards.items():
            bucket.blob(f"raw/{repeat}/{name}").upload_from_file(io.BytesIO(data))

    def sdk_upload_many(repeat: int) -> None:
        pairs = [(io.BytesIO(d), bucket.blob(f"many/{repeat}/{n}")) for n, d in shards.items()]
        results = transfer_manager.upload_many(
            pairs, max_workers=WORKERS, worker_type=transfer_manager.THREAD, raise_exception=True
        )
        assert all(r is None for r in results)

    saved = measure(
        {"sdk upload_from_file": sdk_upload, "sdk upload_many": sdk_upload_many,
         "ckptstore": ckpt_save, "ckptstore part_size=shard": ckpt_save_whole},
        repeats,
    )  # fmt: skip
    print_table(f"GCS save, {layout}", saved, "sdk upload_many", size)
    print_table(f"GCS save, {layout}", saved, "sdk upload_from_file", size)

    buffers = {name: bytearray(len(data)) for name, data in shards.items()}

    def ckpt_load(repeat: int) -> None:
        checkpoint = store.get(repeat + 1)
        for name, buffer in buffers.items():
            checkpoint.read_into(name, buffer)

    def sdk_download(repeat: int) -> None:
        for name in shards:
            bucket.blob(f"raw/{repeat}/{name}").download_to_file(io.BytesIO())

    scratch = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", "bench-gcs")

    def sdk_chunks(repeat: int) -> None:
        for name in shards:
            blob = bucket.get_blob(f"raw/{repeat}/{name}")
            transfer_manager.download_chunks_concurrently(
                blob,
                scratch,
                chunk_size=16 * MiB,
                max_workers=WORKERS,
                worker_type=transfer_manager.THREAD,
            )

    loaded = measure(
        {"sdk download_to_file": sdk_download, "sdk chunks_concurrently": sdk_chunks,
         "ckptstore": ckpt_load},
        repeats,
    )  # fmt: skip
    print_table(f"GCS load, {layout}", loaded, "sdk chunks_concurrently", size)
    print_table(f"GCS load, {layout}", loaded, "sdk download_to_file", size)
    if os.path.exists(scratch):
        os.unlink(scratch)
    for blob in list(client.list_blobs(server.bucket)):
        blob.delete()  # the emulator holds everything in memory


if __name__ == "__main__":
    main()
