"""Opening an ``az://`` or ``abfs[s]://`` store (docs/backends/azure.md): the container,
account and endpoint a URL names, the credential from options or the environment, the shared
BlobServiceClient, and ``AzureBlobDriver`` under a ``ConditionalPutCommit``.

``ckptstore.backends.azure`` (the driver) still serves these names for its old importers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from azure.storage.blob import BlobServiceClient

from ckptstore.backends.azure import READ_PIECE, AzureBlobDriver, ServerClock
from ckptstore.backends.client_cache import ClientCache
from ckptstore.backends.transfer_options import (
    TRANSFER_OPTIONS,
    TransferOptions,
    pooled,
    refuse_credentials_in_url,
)
from ckptstore.commit.conditional_put import DEFAULT_READ_RANGE_SIZE, ConditionalPutCommit
from ckptstore.errors import BackendUnavailableError, InvalidOptionError, InvalidURLError
from ckptstore.urls import StoreURL, endpoint_option, option_int, redact

__all__ = [
    "BODY_PIECE",
    "CREDENTIAL_OPTIONS",
    "MAX_SINGLE_PUT",
    "URL_OPTIONS",
    "make_client",
    "open_azure",
    "parse_location",
]

MAX_SINGLE_PUT = 256 * 1024 * 1024
"""A put up to this size is one Put Blob request (larger ones: blocks, committed at once)."""
BODY_PIECE = 1024 * 1024
"""Bytes per read of a response body."""
_CONTAINER_RE = re.compile(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_HOST_RE = re.compile(r"^(?P<account>[^.]+)\.(?:blob|dfs)\.(?P<suffix>.+)$")

URL_OPTIONS = (*TRANSFER_OPTIONS, "account_name", "read_concurrency", "read_range_size")
CREDENTIAL_OPTIONS = ("connection_string", "account_key", "sas_token", "credential")
_CLIENT_OPTIONS = frozenset(
    {"endpoint_url", "account_name", "concurrency", "connect_timeout", "read_timeout",
     *CREDENTIAL_OPTIONS}
)  # fmt: skip


@dataclass(frozen=True)
class _Client:
    """A BlobServiceClient, the clock its answers feed, and the session under it."""

    service: BlobServiceClient
    clock: ServerClock
    session: Any


_SECRET_ENVIRONMENT = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
)
_clients: ClientCache[_Client] = ClientCache(
    _CLIENT_OPTIONS,
    (*CREDENTIAL_OPTIONS, *_SECRET_ENVIRONMENT),
    disconnect=lambda client: client.session.close(),
    environment=("AZURE_STORAGE_ACCOUNT", *_SECRET_ENVIRONMENT),
)
"""Clients by their options (``ckptstore.backends.client_cache``)."""


def make_client(options: Mapping[str, object]) -> tuple[BlobServiceClient, ServerClock]:
    """A BlobServiceClient (and the clock its answers feed) shared by stores opened with the
    same options. The SDK's own retries are off: ckptstore retries only what is safe."""
    made = _clients.get(options, lambda: _new_client(options))
    return made.service, made.clock


def _new_client(options: Mapping[str, object]) -> _Client:
    import requests
    from azure.core.pipeline.transport import RequestsTransport

    clock = ServerClock()
    transfer = TransferOptions.read(options, min_part_size=1)
    session = pooled(requests.Session(), transfer.pool_size)
    transport = RequestsTransport(
        session=session,
        session_owner=False,
        connection_timeout=transfer.connect_timeout,
        read_timeout=transfer.read_timeout,
        # azure-core reads bodies in pieces of this size (its own default is 4 KiB, the
        # storage SDK's 256 KiB): 4 KiB pieces cost a 8 MiB range 2,048 Python iterations.
        connection_data_block_size=BODY_PIECE,
    )
    settings: dict[str, Any] = {
        "transport": transport,
        "retry_total": 0,  # a resent conditional write could come back as a refusal of our own
        "raw_response_hook": clock.observe,
        "max_single_put_size": MAX_SINGLE_PUT,
        "max_single_get_size": READ_PIECE,
        "max_chunk_get_size": READ_PIECE,
    }
    endpoint, credential = _endpoint_and_credential(options)
    try:
        if isinstance(credential, _ConnectionString):
            if endpoint:
                settings["account_url"] = endpoint
            client = BlobServiceClient.from_connection_string(credential.value, **settings)
        else:
            client = BlobServiceClient(endpoint, credential=credential, **settings)
    except ValueError as exc:  # a malformed connection string, endpoint or key
        raise InvalidOptionError(f"az:// client options: {exc}") from exc
    return _Client(client, clock, session)


@dataclass(frozen=True)
class _ConnectionString:
    value: str


def _endpoint_and_credential(options: Mapping[str, object]) -> tuple[str, Any]:
    """The blob endpoint and the credential, from options first, then the environment, then
    DefaultAzureCredential (azure-identity) when installed."""
    endpoint = endpoint_option(options)
    account = str(options.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT") or "")
    if options.get("connection_string"):
        return endpoint, _ConnectionString(str(options["connection_string"]))
    if not endpoint and not account:
        if os.environ.get("AZURE_STORAGE_CONNECTION_STRING"):
            return "", _ConnectionString(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
        raise InvalidOptionError(
            "az://: no storage account: name it in the URL (az://container@account.blob.core."
            "windows.net/prefix), or pass account_name, endpoint_url or connection_string (or "
            "set AZURE_STORAGE_ACCOUNT or AZURE_STORAGE_CONNECTION_STRING)"
        )
    if endpoint and not account:
        account = _account_of_endpoint(endpoint)
    endpoint = endpoint or f"https://{account}.blob.core.windows.net"
    if options.get("credential") is not None:
        return endpoint, options["credential"]
    if options.get("account_key"):
        return endpoint, {"account_name": account, "account_key": str(options["account_key"])}
    if options.get("sas_token"):
        return endpoint, str(options["sas_token"]).lstrip("?")
    if os.environ.get("AZURE_STORAGE_KEY") and account:
        return endpoint, {"account_name": account, "account_key": os.environ["AZURE_STORAGE_KEY"]}
    if os.environ.get("AZURE_STORAGE_SAS_TOKEN"):
        return endpoint, os.environ["AZURE_STORAGE_SAS_TOKEN"].lstrip("?")
    if os.environ.get("AZURE_STORAGE_CONNECTION_STRING") and not options.get("account_name"):
        return endpoint if options.get("endpoint_url") else "", _ConnectionString(
            os.environ["AZURE_STORAGE_CONNECTION_STRING"]
        )
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:
        raise BackendUnavailableError(
            "az://: no credentials given (connection_string, account_key or sas_token, or "
            "AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY / AZURE_STORAGE_SAS_TOKEN), "
            "and DefaultAzureCredential needs azure-identity: pip install azure-identity"
        ) from exc
    return endpoint, DefaultAzureCredential()


def _account_of_endpoint(endpoint: str) -> str:
    """The account of an endpoint: its host's first label, or an emulator's first path part."""
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint)
    match = _HOST_RE.fullmatch(parts.hostname or "")
    if match:
        return match["account"]
    return parts.path.strip("/").split("/", 1)[0]


def parse_location(url: StoreURL) -> tuple[str, str, str | None, str | None]:
    """Container, prefix, and (from ``container@host``) account and endpoint of an az:// URL.

    Accepts ``az://container/prefix`` and the forms of other tools:
    ``abfs[s]://container@account.dfs.core.windows.net/prefix`` and
    ``az://container@account.blob.core.windows.net/prefix`` (the blob API serves both).
    """
    container, at, host = url.netloc.partition("@")
    account = endpoint = None
    if at:
        if ":" in container:
            raise InvalidURLError(f"{url.shown}: credentials do not belong in a URL")
        match = _HOST_RE.fullmatch(host.lower())
        if match is not None:
            account = match["account"]
            endpoint = f"https://{account}.blob.{match['suffix']}"
        elif _ACCOUNT_RE.fullmatch(host):
            account = host
        else:
            raise InvalidURLError(
                f"{url.shown}: {host!r} is not an Azure storage host (expected "
                f"<account>.blob.core.windows.net or <account>.dfs.core.windows.net)"
            )
        if not _ACCOUNT_RE.fullmatch(account):
            raise InvalidURLError(f"{url.shown}: {account!r} is not a valid storage account name")
    if not _CONTAINER_RE.fullmatch(container) and container != "$root":
        raise InvalidURLError(
            f"{url.shown}: {container!r} is not a valid Azure container name (3-63 lowercase "
            f"letters, digits and single hyphens)"
        )
    return container, url.path.strip("/"), account, endpoint


def open_azure(url: StoreURL, options: Mapping[str, object]) -> ConditionalPutCommit:
    """Open an ``az://container/prefix`` store (also ``abfs[s]://container@account...``):
    AzureBlobDriver + ConditionalPutCommit, reading a large shard as ``read_concurrency``
    ranged GetBlobs at once (default: the upload ``concurrency``; also the ranges a stream
    fetches ahead) of ``read_range_size`` bytes each (default 16 MiB)."""
    refuse_credentials_in_url(url, CREDENTIAL_OPTIONS, "the environment")
    url.reject_unknown(options, allowed=URL_OPTIONS + CREDENTIAL_OPTIONS)
    container, prefix, account, endpoint = parse_location(url)
    merged = dict(options)
    if account is not None:
        given = options.get("account_name")
        if given and str(given) != account:
            raise InvalidOptionError(
                f"{url.shown}: the URL names account {account!r}, account_name says {given!r}"
            )
        merged["account_name"] = account
        if endpoint and not options.get("endpoint_url"):
            merged["endpoint_url"] = endpoint
    transfer = TransferOptions.read(options, min_part_size=1)
    read_concurrency = option_int(options, "read_concurrency", transfer.concurrency, minimum=1)
    read_range_size = option_int(options, "read_range_size", DEFAULT_READ_RANGE_SIZE, minimum=1)
    lease = _clients.lease(merged, lambda: _new_client(merged))
    client, clock = lease.client.service, lease.client.clock
    driver = AzureBlobDriver(
        client.get_container_client(container),
        container,
        prefix,
        url=redact(f"{url.scheme}://{url.netloc}/{prefix}".rstrip("/")),
        identity=f"{client.url.rstrip('/')}/{container}",
        clock=clock,
        min_part_size=transfer.min_part_size,
        checksums=transfer.checksums,
        max_attempts=transfer.max_attempts,
        read_concurrency=read_concurrency,
    )
    driver.on_close(lease.release)  # the store's close lets go of the session's connections
    return ConditionalPutCommit(
        driver,
        part_size=transfer.part_size,
        concurrency=transfer.concurrency,
        read_concurrency=read_concurrency,
        read_range_size=read_range_size,
    )
