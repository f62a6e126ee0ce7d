"""Opening an ``fsspec+<protocol>://<path>`` store: the implementation, its options, the driver
(``FsspecDriver``, or ``S3fsDriver`` on s3fs) and the strategy (docs/backends/fsspec.md).

Apart from the drivers so that neither driver module imports the other.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.registry import known_implementations

from ckptstore.backends.fsspec import (
    ATOMIC_CREATE,
    CKPTSTORE_OPTIONS,
    INSTALL_HINT,
    S3FS,
    SCHEME_PREFIX,
    SECRET_OPTIONS,
    UNSAFE_OPTION,
    FsspecDriver,
    FsspecReadOnlyCommit,
    implementation_name,
)
from ckptstore.backends.fsspec_s3 import S3fsDriver
from ckptstore.commit.conditional_put import DEFAULT_PART_SIZE, ConditionalPutCommit
from ckptstore.driver import Capability
from ckptstore.errors import (
    BackendUnavailableError,
    InvalidOptionError,
    InvalidURLError,
    UnknownSchemeError,
)
from ckptstore.urls import StoreURL, endpoint_option, option_bool, option_int, redact

__all__ = ["make_driver", "open_fsspec", "protocol_of"]

log = logging.getLogger(__name__)


def protocol_of(url: StoreURL) -> str:
    """The fsspec protocol of an ``fsspec+<protocol>://`` URL, known to fsspec."""
    protocol = url.scheme[len(SCHEME_PREFIX) :] if url.scheme.startswith(SCHEME_PREFIX) else ""
    if not protocol:
        raise InvalidURLError(f"{url.shown}: expected fsspec+<protocol>://..., e.g. fsspec+s3://")
    if protocol not in fsspec.available_protocols():
        raise UnknownSchemeError(
            f"{url.shown}: fsspec knows no protocol {protocol!r}; fsspec's protocols: "
            f"{', '.join(sorted(fsspec.available_protocols()))}"
        )
    return protocol


def _filesystem_class(protocol: str) -> type:
    try:
        klass: type = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        spec = known_implementations.get(protocol, {})
        package = str(spec.get("class", protocol)).split(".", 1)[0]
        raise BackendUnavailableError(
            f"fsspec+{protocol}:// needs {package}, which is not installed: "
            f"{INSTALL_HINT} {package} ({exc})"
        ) from exc
    return klass


def _storage_options(url: StoreURL, options: Mapping[str, object], protocol: str) -> dict[str, Any]:
    """What goes to ``fsspec.filesystem``: every option but ckptstore's own; URL strings
    ``true``/``false`` and integers become bool and int. Listing caches are off (a cached
    listing would hide other writers' objects)."""
    leaked = sorted(set(url.query) & SECRET_OPTIONS)
    if leaked:
        raise InvalidOptionError(
            f"credentials ({', '.join(leaked)}) do not belong in a URL, where they end up in "
            f"logs; pass them as keyword arguments or through the implementation's own chain"
        )
    endpoint_option(options)  # an endpoint with user:password@: refused, never logged
    storage: dict[str, Any] = {"use_listings_cache": False}
    if protocol in ("file", "local"):
        storage["auto_mkdir"] = True
    if protocol in ("s3", "s3a") and "config_kwargs" not in options:
        # botocore's own retries off (s3fs keeps its few): a conditional put resent blindly
        # comes back as a refusal of our own write, and an unreachable endpoint fails fast.
        storage["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"}}
    for name, value in options.items():
        if name in CKPTSTORE_OPTIONS:
            continue
        if name in url.query and isinstance(value, str):
            lowered = value.lower()
            if lowered in ("true", "false"):
                value = lowered == "true"
            elif value.isdigit():
                value = int(value)
        storage[name] = value
    return storage


def _endpoint(storage: Mapping[str, Any]) -> str:
    for name in ("endpoint_url", "account_host", "account_name", "host"):
        if storage.get(name):
            return str(storage[name])
    client_kwargs = storage.get("client_kwargs")
    if isinstance(client_kwargs, Mapping) and client_kwargs.get("endpoint_url"):
        return str(client_kwargs["endpoint_url"])
    connection = str(storage.get("connection_string") or "")
    for field in connection.split(";"):  # the endpoint only, never the key
        if field.startswith("BlobEndpoint="):
            return field.partition("=")[2]
    return ""


def make_driver(url: StoreURL, options: Mapping[str, object]) -> FsspecDriver:
    """An FsspecDriver for an ``fsspec+<protocol>://`` URL and options."""
    protocol = protocol_of(url)
    _filesystem_class(protocol)  # a missing implementation package: its own clear error
    storage = _storage_options(url, options, protocol)
    try:
        fs = fsspec.filesystem(protocol, **storage)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(f"{url.shown}: storage options for {protocol}: {exc}") from exc
    location = f"{url.netloc}{url.path}".rstrip("/")
    root = str(fsspec.core.strip_protocol(f"{protocol}://{location}")).rstrip("/")
    if not root.strip("/") and protocol not in ("file", "local", "memory"):
        raise InvalidURLError(f"{url.shown}: no bucket or container in the URL")
    implementation = implementation_name(fs)
    unsafe = option_bool(options, UNSAFE_OPTION, False)
    atomic = implementation in ATOMIC_CREATE
    if unsafe and not atomic:
        log.warning("%s: %s: writing although create-if-absent is not atomic there", url.shown,
                    UNSAFE_OPTION)  # fmt: skip
    min_part = options.get("min_part_size")
    driver_class = S3fsDriver if implementation == S3FS else FsspecDriver
    return driver_class(
        fs,
        root,
        url=redact(f"{url.scheme}://{location}"),
        endpoint=_endpoint(storage),
        atomic_create=atomic,
        unsafe=unsafe,
        min_part_size=option_int(options, "min_part_size", 1, minimum=1) if min_part else None,
        max_attempts=option_int(options, "max_attempts", 4, minimum=1),
    )


def open_fsspec(url: StoreURL, options: Mapping[str, object]) -> ConditionalPutCommit:
    """Open an ``fsspec+<protocol>://path`` store: FsspecDriver + ConditionalPutCommit.

    Read-only (``FsspecReadOnlyCommit``) on an implementation whose create is not atomic,
    unless ``unsafe_non_atomic_create=true``. Streamed shards (every implementation but s3fs)
    are written one part after another: ``concurrency`` applies to s3fs's multipart only.
    """
    driver = make_driver(url, options)
    part_size = option_int(
        options, "part_size", max(DEFAULT_PART_SIZE, driver.min_part_size), minimum=1
    )
    concurrency = option_int(options, "concurrency", 8, minimum=1)
    if Capability.MULTIPART not in driver.capabilities:
        concurrency = 1  # a stream takes its parts in order
    commit = FsspecReadOnlyCommit if driver.refusal is not None else ConditionalPutCommit
    return commit(driver, part_size=part_size, concurrency=concurrency)
