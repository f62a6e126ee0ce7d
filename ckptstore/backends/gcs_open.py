"""Opening a ``gs://`` or ``gs+versioned://`` store (docs/backends/gcs.md): the URL, the
credentials, the client and its authorized session shared by equal options, and ``GCSDriver``
under the commit strategy. ``ckptstore.backends.gcs``, the driver, still serves these names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage

from ckptstore.backends.client_cache import ClientCache
from ckptstore.backends.gcs import UPLOADS, GCSDriver
from ckptstore.backends.gcs_errors import translate_gcs_errors
from ckptstore.backends.transfer_options import TRANSFER_OPTIONS, TransferOptions, bucket_of, pooled
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.commit.version_pin import VersionPinCommit
from ckptstore.errors import CapabilityError, InvalidOptionError, InvalidURLError, StorageError
from ckptstore.urls import StoreURL, endpoint_option, option_int, redact

__all__ = [
    "URL_OPTIONS",
    "make_client",
    "make_transport",
    "open_gcs",
    "open_gcs_versioned",
    "parse_location",
]

URL_OPTIONS = (*TRANSFER_OPTIONS, "project", "credentials_file", "token", "read_concurrency")

_CLIENT_OPTIONS = ("endpoint_url", "project", "credentials_file", "token", "concurrency")
_clients: ClientCache[tuple[Any, Any]] = ClientCache(
    _CLIENT_OPTIONS,
    ("token",),
    disconnect=lambda transport: transport[1].close(),
    environment=("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT"),
)
"""Clients and their sessions by their options (``ckptstore.backends.client_cache``)."""


def make_client(options: Mapping[str, object]) -> Any:
    """A google.cloud.storage.Client from options (see ``make_transport``)."""
    return make_transport(options)[0]


def make_transport(options: Mapping[str, object]) -> tuple[Any, Any]:
    """A google.cloud.storage.Client from options and its authorized requests session, shared
    by stores opened with the same options.

    Credentials: ``token=anonymous`` or an ``endpoint_url`` (an emulator) sign nothing;
    ``credentials_file`` is a service-account JSON; else Application Default Credentials.
    ``STORAGE_EMULATOR_HOST`` is honoured as the client does. The client's own retries are
    off (every call passes ``retry=None``): ckptstore retries only what is safe to retry.
    """
    return _clients.get(options, lambda: _new_client(options))


def _new_client(options: Mapping[str, object]) -> tuple[Any, Any]:
    endpoint = endpoint_option(options) or os.environ.get("STORAGE_EMULATOR_HOST") or ""
    token = str(options.get("token") or "")
    if token not in ("", "anonymous"):  # the value given is not echoed: it may be a real token
        raise InvalidOptionError(
            "token must be 'anonymous' (or absent): an access token does not belong in the "
            "options, where it ends up in logs; use credentials_file or Application Default "
            "Credentials"
        )
    credentials_file = str(options.get("credentials_file") or "")
    project = str(options.get("project") or "") or None
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise InvalidOptionError(
            f"endpoint_url must be an http(s):// URL, not {redact(endpoint)!r}"
        )
    try:
        if credentials_file:
            from google.oauth2 import service_account

            credentials: Any = service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call]
                credentials_file,
                scopes=["https://www.googleapis.com/auth/devstorage.read_write"],
            )
            project = project or credentials.project_id
        elif token == "anonymous" or options.get("endpoint_url") or endpoint:
            credentials = AnonymousCredentials()  # type: ignore[no-untyped-call]
            project = project or "anonymous"
        else:
            import google.auth

            with translate_gcs_errors("finding Application Default Credentials", bucket=""):
                credentials, found = google.auth.default(
                    scopes=["https://www.googleapis.com/auth/devstorage.read_write"]
                )
            project = project or found
    except (OSError, ValueError) as exc:
        if isinstance(exc, StorageError):
            raise
        raise InvalidOptionError(f"gs:// credentials_file {credentials_file!r}: {exc}") from exc
    pool = TransferOptions.read(options, min_part_size=1).pool_size
    session = pooled(AuthorizedSession(credentials), pool, max_retries=0)  # type: ignore[no-untyped-call]
    client_options = ClientOptions(api_endpoint=endpoint) if endpoint else None
    client = storage.Client(
        project=project or "_",
        credentials=credentials,
        _http=session,
        client_options=client_options,
    )
    return client, session


def parse_location(url: StoreURL) -> tuple[str, str]:
    """Bucket and prefix of a gs:// URL, validated (GCS bucket naming rules)."""
    bucket = bucket_of(url, "a gs:// URL", "Application Default Credentials")
    name_ok = 3 <= len(bucket) <= 222 and all(
        c.islower() or c.isdigit() or c in "-_." for c in bucket
    )
    if (
        not name_ok
        or not bucket[0].isalnum()
        or not bucket[-1].isalnum()
        or ".." in bucket
        or bucket.startswith("goog")
    ):
        raise InvalidURLError(f"{url.shown}: {bucket!r} is not a valid GCS bucket name")
    prefix = url.path.strip("/")
    if prefix.startswith(UPLOADS.rstrip("/")) or "/" + UPLOADS in prefix + "/":
        raise InvalidURLError(f"{url.shown}: {UPLOADS!r} is ckptstore's own (upload pieces)")
    return bucket, prefix


def open_gcs(url: StoreURL, options: Mapping[str, object]) -> ConditionalPutCommit:
    """Open a ``gs://bucket/prefix`` store: GCSDriver + ConditionalPutCommit."""
    driver, part_size, concurrency = _gcs_driver(url, options, versioned=False)
    return ConditionalPutCommit(driver, part_size=part_size, concurrency=concurrency)


def open_gcs_versioned(url: StoreURL, options: Mapping[str, object]) -> VersionPinCommit:
    """Open a ``gs+versioned://bucket/prefix`` store: GCSDriver + VersionPinCommit
    (manifests pin generations). The bucket must have object versioning enabled."""
    driver, part_size, concurrency = _gcs_driver(url, options, versioned=True)
    return _VersionedGCSCommit(driver, part_size=part_size, concurrency=concurrency)


class _VersionedGCSCommit(VersionPinCommit):
    """VersionPinCommit whose refusal of an unversioned bucket names the gcloud command."""

    def open_root(self, *, create: bool) -> None:
        try:
            super().open_root(create=create)
        except CapabilityError as exc:
            raise CapabilityError(
                f"{self.url}: object versioning is not enabled on the bucket; gs+versioned:// "
                f"pins generations and needs it. Enable it (gcloud storage buckets update "
                f"gs://BUCKET --versioning), or use gs:// for an unversioned bucket"
            ) from exc


def _gcs_driver(
    url: StoreURL, options: Mapping[str, object], *, versioned: bool
) -> tuple[GCSDriver, int, int]:
    url.reject_unknown(options, allowed=URL_OPTIONS)
    bucket, prefix = parse_location(url)
    transfer = TransferOptions.read(options, min_part_size=1)
    read_concurrency = option_int(options, "read_concurrency", 8, minimum=1)
    lease = _clients.lease(options, lambda: _new_client(options))
    client, session = lease.client
    driver = GCSDriver(
        client,
        bucket,
        prefix,
        url=f"{url.scheme}://{bucket}/{prefix}".rstrip("/"),
        min_part_size=transfer.min_part_size,
        checksums=transfer.checksums,
        max_attempts=transfer.max_attempts,
        versioned=versioned,
        timeout=(float(transfer.connect_timeout), float(transfer.read_timeout)),
        read_concurrency=read_concurrency,
        http=session,
    )
    driver.on_close(lease.release)  # the store's close lets go of the session's connections
    return driver, transfer.part_size, transfer.concurrency
