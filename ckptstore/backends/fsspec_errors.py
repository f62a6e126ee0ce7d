"""The one place where fsspec implementations' errors become ckptstore's (docs/backends/fsspec.md).

fsspec implementations raise built-in errors for what they understand (FileNotFoundError,
FileExistsError, PermissionError, OSError with an errno) and let their transport's exceptions
through for the rest (botocore's EndpointConnectionError from s3fs, aiohttp's from gcsfs, the
Azure SDK's HttpResponseError from adlfs). Those are recognised by class name and HTTP status,
so that this module imports none of the implementations: any of them may be missing.

A failure after which a write may or may not have happened (a timeout, a connection broken after
the request was sent) is an ``IndeterminateOutcomeError``: the caller reads back (I8).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptstore.backends.error_table import translating
from ckptstore.errors import (
    CkptStoreError,
    IndeterminateOutcomeError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageAccessDeniedError,
    StorageError,
    TransientStorageError,
)

if TYPE_CHECKING:
    from ckptstore.backends.error_table import Rules

__all__ = ["FSSPEC_RULES", "http_status", "translate_fsspec_errors"]

_NOT_SENT = {
    "EndpointConnectionError",  # botocore (s3fs)
    "ConnectTimeoutError",
    "ClientConnectorError",  # aiohttp (gcsfs, s3fs's aiobotocore)
    "ServiceRequestError",  # azure-core: the request could not be sent (adlfs)
    "ConnectionRefusedError",
}
"""Failures before the request left: nothing happened."""
_BROKEN = {
    "HTTPClientError",  # botocore: ConnectionClosedError, ReadTimeoutError
    "ServerDisconnectedError",  # aiohttp
    "ClientPayloadError",
    "ClientOSError",
    "ServiceResponseError",  # azure-core: the answer was lost
    "IncompleteRead",
    "FSTimeoutError",  # fsspec's sync() timeout
}
"""Failures after the request may have reached the server."""
_DENIED_NAMES = {"NoCredentialsError", "PartialCredentialsError", "ClientAuthenticationError"}


def _names(exc: BaseException) -> set[str]:
    return {klass.__name__ for klass in type(exc).__mro__}


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it was raised from or while handling, up to the first of
    ckptstore's own: an error raised while ckptstore handled an earlier one (reading an epoch
    back after a refused create) is not that earlier error, whose 412 it must not inherit."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if current is not exc and isinstance(current, CkptStoreError):
            return
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an implementation's error (or one it was raised from) carries."""
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        for attribute in ("status_code", "code", "status"):  # azure-core, gcsfs HttpError
            value = getattr(link, attribute, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
    return None


FSSPEC_RULES: Rules = ((Exception, lambda exc, what, _: _translate(exc, what, create=False)),)
"""Every exception, by what it says of itself (implementations are recognised by name)."""
_CREATE_RULES: Rules = ((Exception, lambda exc, what, _: _translate(exc, what, create=True)),)


@contextlib.contextmanager
def translate_fsspec_errors(what: str, *, create: bool = False) -> Iterator[None]:
    """Translate an fsspec implementation's errors raised inside the block, naming ``what``.

    ``create``: the block is a conditional create, where "exists" (FileExistsError, HTTP 412, or
    Azure's 409 ``BlobAlreadyExists``) is the refusal ``PreconditionFailedError``.
    """
    with translating(_CREATE_RULES if create else FSSPEC_RULES, what, ""):
        yield


def _translate(exc: BaseException, what: str, *, create: bool) -> StorageError:
    status = http_status(exc)
    names = set().union(*(_names(link) for link in _chain(exc)))
    message = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, FileExistsError) or (create and status in (409, 412)):
        if create:
            return PreconditionFailedError(f"{what}: the key exists", http_status=status or 412)
        return StorageError(errno.EEXIST, message)
    if status == 412:
        return PreconditionFailedError(message, http_status=412)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return ObjectNotFoundError(errno.ENOENT, message, http_status=status)
    if isinstance(exc, PermissionError) or status in (401, 403) or names & _DENIED_NAMES:
        return StorageAccessDeniedError(
            errno.EACCES, f"{message} (check the credentials and their permissions)"
        )
    if names & _NOT_SENT:
        return TransientStorageError(errno.ECONNREFUSED, f"{what}: cannot reach the storage: {exc}")
    timeout = isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or any(
        "Timeout" in name for name in names
    )
    if timeout or names & _BROKEN or isinstance(exc, ConnectionError):
        return IndeterminateOutcomeError(
            errno.ETIMEDOUT if timeout else errno.ECONNRESET,
            f"{message}; the request may have taken effect",
        )
    if status is not None and (status in (408, 429) or status >= 500):
        return TransientStorageError(message, http_status=status)
    code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
    return StorageError(code, message, http_status=status)
