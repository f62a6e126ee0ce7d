"""Read of one large blob from Azurite: the azure-storage-blob SDK against obstore.

    python -m benchmarks.bench_obstore_azure [--size 256M] [--repeats 5] [--concurrency 8]

Measures whether obstore would speed up shard reads on Azure (it does not go through
ckptstore's Azure driver). Starts Azurite (``azurite-blob``, in memory) on 127.0.0.1: found
through ``CKPTSTORE_AZURITE``, then ``.cache/azurite`` of this checkout, then PATH. Every
contender reads the same blob into one preallocated buffer, interleaved:

- ``azure download_blob x N`` (the baseline): ``download_blob(max_concurrency=N).readinto``;
- ``azure download_blob x1``: one thread; both with the SDK's default 4 MiB chunks (a first
  GET of 32 MiB, then ranged GETs), then with 16 MiB chunks, and as one GET; and with 16 MiB
  chunks read from the socket 1 MiB at a time (``connection_data_block_size``: azure-core's
  default is 4 KiB, a Python call per 4 KiB);
- ``obstore get`` (one streamed GET) and ``obstore get_range x N`` (16 MiB ranges on N threads).

Prints medians and ratios; never fails on a time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.bench_s3_load import RANGE, _Preallocated
from ckptstore.tools.embedded import free_port
from ckptstore.tools.timing import measure, print_table, sizes

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account key (public, documented by Microsoft)."""


def _azurite_binary() -> str:
    candidates = [
        os.environ.get("CKPTSTORE_AZURITE", ""),
        str(
            Path(__file__).resolve().parent.parent
            / ".cache/azurite/node_modules/.bin"
            / "azurite-blob"
        ),
        shutil.which("azurite-blob") or "",
    ]
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return candidate
    raise SystemExit("azurite-blob not found: npm install --prefix .cache/azurite azurite")


@contextlib.contextmanager
def _azurite() -> Iterator[str]:
    """Azurite's blob service on 127.0.0.1; yields its endpoint (with the account)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ckptstore-azurite-") as directory:
        command = [
            _azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port),
            "--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry",
        ]  # fmt: skip
        process = subprocess.Popen(
            command,
            cwd=directory,  # nothing is written in memory mode; if a version does, it goes here
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("azurite-blob did not start")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port}/{ACCOUNT}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    size = sizes([args.size])[0]
    concurrency = args.concurrency
    import obstore
    from azure.storage.blob import BlobServiceClient
    from obstore.store import AzureStore

    with _azurite() as endpoint:
        credential = {"account_name": ACCOUNT, "account_key": KEY}
        service = BlobServiceClient(endpoint, credential=credential)
        large = BlobServiceClient(  # 16 MiB ranges, as obstore's get_range contender reads
            endpoint, credential=credential, max_single_get_size=RANGE, max_chunk_get_size=RANGE
        )
        whole = BlobServiceClient(endpoint, credential=credential, max_single_get_size=size)
        tuned = BlobServiceClient(  # azure-core reads a body 4 KiB at a time unless told
            endpoint,
            credential=credential,
            max_single_get_size=RANGE,
            max_chunk_get_size=RANGE,
            connection_data_block_size=1024 * 1024,
        )
        with service, large, whole, tuned:
            container = service.create_container("bench")
            blob = container.get_blob_client("shard")
            blob.upload_blob(os.urandom(size), overwrite=True, max_concurrency=4)
            store = AzureStore(
                "bench",
                account_name=ACCOUNT,
                account_key=KEY,
                endpoint=endpoint,
                client_options={"allow_http": True},
            )
            buffer = bytearray(size)
            view = memoryview(buffer)

            def sdk(threads: int, client: BlobServiceClient = service) -> Callable[[int], object]:
                source = client.get_blob_client("bench", "shard")

                def read(repeat: int) -> None:
                    source.download_blob(max_concurrency=threads).readinto(_Preallocated(buffer))

                return read

            def streamed(repeat: int) -> None:
                position = 0
                for chunk in obstore.get(store, "shard"):
                    count = len(chunk)
                    view[position : position + count] = chunk
                    position += count

            def ranged(repeat: int) -> None:
                def one(start: int) -> None:
                    end = min(start + RANGE, size)
                    view[start:end] = memoryview(
                        obstore.get_range(store, "shard", start=start, end=end)
                    )

                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(one, range(0, size, RANGE)))

            contenders: dict[str, Callable[[int], object]] = {
                f"azure download_blob x{concurrency}": sdk(concurrency),
                "azure download_blob x1": sdk(1),
                f"azure download_blob x{concurrency}, 16 MiB chunks": sdk(concurrency, large),
                "azure download_blob, one GET": sdk(1, whole),
                f"azure download_blob x{concurrency}, 16 MiB chunks, 1 MiB reads": sdk(
                    concurrency, tuned
                ),
                "obstore get": streamed,
                f"obstore get_range x{concurrency}": ranged,
            }
            results = measure(contenders, args.repeats)
            print_table(
                f"Azure read of one {size / 2**20:.0f} MiB blob (Azurite, {args.repeats} repeats, "
                f"load average {os.getloadavg()[0]:.1f} at the end)",
                results,
                f"azure download_blob x{concurrency}",
                size,
            )


if __name__ == "__main__":
    main()
