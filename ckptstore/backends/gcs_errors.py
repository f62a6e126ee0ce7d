"""The one place where google-cloud-storage's errors become ckptstore's (docs/backends/gcs.md).

google.api_core maps every JSON API answer to a ``GoogleAPICallError`` carrying its status:
404 is a missing object (or bucket), 412 a lost ``ifGenerationMatch``, 401/403 a refusal of
the credentials, 429 and 5xx are transient. Transport failures come from requests/urllib3:
a connection that was never made (refused, connect timeout) is safe to retry; one that broke
after the request may have reached the server is an ``IndeterminateOutcomeError``, which a
conditional write resolves by reading back (I8). google-auth's errors (no credentials, a
refresh refused) are access errors. No third-party exception crosses the driver boundary.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
from collections.abc import Iterator

import google.auth.exceptions as auth_errors
import requests.exceptions
import urllib3.exceptions
from google.api_core import exceptions as api
from google.cloud.storage import exceptions as storage_exceptions

from ckptstore.errors import (
    CkptStoreError,
    IndeterminateOutcomeError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageAccessDeniedError,
    StorageError,
    StoreNotFoundError,
    TransientStorageError,
)

__all__ = ["translate_gcs_errors"]


@contextlib.contextmanager
def translate_gcs_errors(what: str, *, bucket: str) -> Iterator[None]:
    """Translate google-cloud-storage errors raised inside the block into ckptstore errors
    naming ``what``."""
    try:
        yield
    except CkptStoreError:
        raise  # translated already (a nested block)
    except api.GoogleAPICallError as exc:
        raise _from_api_error(exc, what, bucket) from exc
    except requests.exceptions.SSLError as exc:
        raise StorageError(errno.EIO, f"{what}: TLS failed: {exc}") from exc
    except (requests.exceptions.ConnectTimeout, requests.exceptions.ConnectionError) as exc:
        if _not_sent(exc):
            raise TransientStorageError(
                errno.ECONNREFUSED, f"{what}: cannot reach the GCS endpoint: {exc}"
            ) from exc
        raise _broken(what, exc) from exc
    except (
        auth_errors.DefaultCredentialsError,
        auth_errors.RefreshError,
    ) as exc:
        raise StorageAccessDeniedError(
            errno.EACCES,
            f"{what}: no usable Google credentials (Application Default Credentials, "
            f"credentials_file=, or token=anonymous for an emulator): {exc}",
        ) from exc
    except auth_errors.TransportError as exc:
        raise TransientStorageError(errno.ECONNREFUSED, f"{what}: {exc}") from exc
    except storage_exceptions.DataCorruption as exc:  # a checksum of the answer did not match
        raise _broken(what, exc) from exc
    except _BROKEN as exc:
        raise _broken(what, exc) from exc
    except auth_errors.GoogleAuthError as exc:
        raise StorageAccessDeniedError(errno.EACCES, f"{what}: {exc}") from exc
    except OSError as exc:  # a socket error no library wrapped
        raise _broken(what, exc) from exc


_BROKEN = (
    requests.exceptions.RequestException,  # ReadTimeout, ChunkedEncodingError, ...
    urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError when requests lets them by
    http.client.HTTPException,  # IncompleteRead, RemoteDisconnected
    storage_exceptions.InvalidResponse,  # an upload/download answer the client could not use
)
"""Failures after the request may have reached the server: the exchange broke."""


def _not_sent(exc: requests.exceptions.RequestException) -> bool:
    """True when the connection was never made (refused, unresolvable, connect timeout):
    retrying cannot duplicate the request."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    reason: object = exc.args[0] if exc.args else None
    reason = getattr(reason, "reason", reason)  # urllib3's MaxRetryError wraps the cause
    return isinstance(
        reason, (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError)
    )


def _broken(what: str, exc: BaseException) -> IndeterminateOutcomeError:
    """The exchange broke after the request may have been sent: worth retrying where that is
    safe, and for a conditional write an unknown outcome to resolve by reading back (I8)."""
    timeout = isinstance(
        exc, (requests.exceptions.Timeout, TimeoutError, urllib3.exceptions.TimeoutError)
    )
    code = errno.ETIMEDOUT if timeout else errno.ECONNRESET
    return IndeterminateOutcomeError(
        code, f"{what}: the connection broke ({exc}); the request may have taken effect"
    )


def _from_api_error(exc: api.GoogleAPICallError, what: str, bucket: str) -> CkptStoreError:
    status = int(exc.code or 0)
    message = f"{what}: {status}: {exc.message}"
    if status == 404:
        if "specified bucket does not exist" in str(exc.message).lower():  # GCS's own words
            return StoreNotFoundError(
                f"{what}: bucket {bucket!r} does not exist (ckptstore never creates buckets)"
            )
        return ObjectNotFoundError(errno.ENOENT, message, http_status=404)
    if status == 412:
        return PreconditionFailedError(message, http_status=412)
    if status in (401, 403):
        return StorageAccessDeniedError(
            errno.EACCES,
            f"{message} (check the credentials and their permissions on {bucket!r})",
            http_status=status,
        )
    if status in (408, 429) or status >= 500:
        return TransientStorageError(message, http_status=status)
    return StorageError(message, http_status=status or None)
