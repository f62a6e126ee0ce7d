"""Embedded Azure Blob Storage (Azurite) on 127.0.0.1, for the demo, the conformance defaults
and the tests.

``embedded_azurite()`` runs Azurite's blob service (npm ``azurite``, ``azurite-blob``) as a
child process with in-memory persistence, waits until it answers, creates a container, and
yields an ``EmbeddedAzure``; the server stops after. Azurite serves the well-known development
account ``devstoreaccount1`` with its published key. Nothing listens anywhere but the loopback
interface, and Azurite's telemetry is off.

Azurite is found through the environment variable ``CKPTSTORE_AZURITE`` (the path of
``azurite-blob``), then in ``.cache/azurite`` of the checkout (where ``.ci/run`` installs it),
then on PATH.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import BackendUnavailableError, StorageError
from ckptstore.tools.embedded import _stop, free_port, server_log_on_failure, start_server

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "AZURITE_VERSION",
    "EmbeddedAzure",
    "azurite_binary",
    "embedded_azurite",
]

AZURITE_VERSION = "3.37.0"
"""The version ``.ci/run`` installs (3.37 is the first to honour ``startFrom`` in listings)."""
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
"""Azurite's well-known development key (published in its README; not a secret)."""
INSTALL_HINT = (
    f"npm install --prefix .cache/azurite --engine-strict=false azurite@{AZURITE_VERSION} "
    f"(in the checkout; `.ci/run` does it), or set CKPTSTORE_AZURITE to the path of azurite-blob"
)


@dataclass(frozen=True)
class EmbeddedAzure:
    """A running Azurite blob service: where it listens, how to sign in, and a container."""

    endpoint_url: str
    """The blob endpoint including the account: ``http://127.0.0.1:P/devstoreaccount1``."""
    account_name: str
    account_key: str
    container: str

    @property
    def connection_string(self) -> str:
        """The connection string the Azure SDKs and tools take."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account_name};"
            f"AccountKey={self.account_key};BlobEndpoint={self.endpoint_url};"
        )

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``ckptstore.open`` (credentials included)."""
        return {
            "endpoint_url": self.endpoint_url,
            "account_name": self.account_name,
            "account_key": self.account_key,
        }

    def url(self, prefix: str, scheme: str = "az", **query: object) -> str:
        """An ``az://container/prefix`` URL in this server's container (endpoint in the query).

        For ``fsspec+abfs`` the endpoint travels in ``options``/``environment()`` instead.
        """
        params: dict[str, object] = {}
        if scheme in ("az", "abfs", "abfss"):
            params["endpoint_url"] = self.endpoint_url
        params.update(query)
        query_text = "&".join(f"{k}={v}" for k, v in params.items())
        url = f"{scheme}://{self.container}/{prefix.strip('/')}"
        return f"{url}?{query_text}" if query_text else url

    def with_container(self, name: str) -> EmbeddedAzure:
        """This server with another container, created if absent."""
        other = dataclasses.replace(self, container=name)
        _create_container(other)
        return other

    def client(self, **kwargs: Any) -> Any:
        """An ``azure.storage.blob.BlobServiceClient`` for this server (close it after use);
        ``kwargs`` go to the client (``retry_total=0``...)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string, **kwargs)

    def environment(self) -> dict[str, str]:
        """Environment variables that let a child process (or adlfs) reach this server."""
        return {
            "AZURE_STORAGE_CONNECTION_STRING": self.connection_string,
            "AZURE_STORAGE_ACCOUNT": self.account_name,
            "AZURE_STORAGE_KEY": self.account_key,
        }


def azurite_binary() -> str:
    """Path of ``azurite-blob``: $CKPTSTORE_AZURITE, the checkout's .cache, then PATH."""
    configured = os.environ.get("CKPTSTORE_AZURITE")
    if configured:
        if not os.access(configured, os.X_OK):
            raise BackendUnavailableError(
                f"CKPTSTORE_AZURITE={configured} is not an executable azurite-blob; {INSTALL_HINT}"
            )
        return configured
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cached = os.path.join(checkout, ".cache", "azurite", "node_modules", ".bin", "azurite-blob")
    if os.access(cached, os.X_OK):
        return cached
    found = shutil.which("azurite-blob")
    if not found:
        raise BackendUnavailableError(f"Azurite (azurite-blob) was not found: {INSTALL_HINT}")
    return found


def _create_container(server: EmbeddedAzure) -> None:
    from azure.core.exceptions import ResourceExistsError

    # No SDK retries: against a server still starting they would wait for minutes.
    with server.client(retry_total=0) as client, contextlib.suppress(ResourceExistsError):
        client.create_container(server.container)


def _wait_for_container(server: EmbeddedAzure, seconds: float, alive: Any) -> None:
    deadline = time.monotonic() + seconds
    last: Exception | None = None
    while time.monotonic() < deadline and alive():
        try:
            _create_container(server)
            return
        except Exception as exc:  # not up yet: connection refused
            last = exc
            time.sleep(0.1)
    raise StorageError(f"embedded Azurite did not come up on {server.endpoint_url}: {last}")


@contextlib.contextmanager
def embedded_azurite(container: str = "ckptstore") -> Iterator[EmbeddedAzure]:
    """Azurite's blob service as a child process on 127.0.0.1, in memory, with ``container``."""
    try:
        import azure.storage.blob  # noqa: F401 - only to say clearly when it is missing
    except ImportError as exc:
        raise BackendUnavailableError(
            "the embedded Azure Blob emulator needs azure-storage-blob: "
            "pip install 'ckptstore[azure]'"
        ) from exc
    binary = azurite_binary()
    with tempfile.TemporaryDirectory(prefix="ckptstore-azurite-") as directory:
        port = free_port()
        command = [
            binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
            "--skipApiVersionCheck", "--disableTelemetry", "--silent",
        ]  # fmt: skip
        log_path = os.path.join(directory, "azurite.log")
        with open(log_path, "wb") as log_file:
            process = start_server(command, log_file, stdin=subprocess.DEVNULL, cwd=directory)
        try:
            endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
            server = EmbeddedAzure(endpoint, AZURITE_ACCOUNT, AZURITE_KEY, container)
            with server_log_on_failure("azurite", log_path):
                _wait_for_container(server, 60, alive=lambda: process.poll() is None)
            yield server
        finally:
            _stop(process)
