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
from typing import TYPE_CHECKING

import google.auth.exceptions as auth_errors
import requests.exceptions
import urllib3.exceptions
from google.api_core import exceptions as api
from google.cloud.storage import exceptions as storage_exceptions

from ckptstore.backends.error_table import (
    AnswerTable,
    broken_rule,
    no_credentials,
    translating,
    unreachable,
)
from ckptstore.errors import (
    CkptStoreError,
    StorageAccessDeniedError,
    StorageError,
    TransientStorageError,
)

if TYPE_CHECKING:
    from ckptstore.backends.error_table import Rules

__all__ = ["GCS_RULES", "translate_gcs_errors"]

ANSWERS = AnswerTable()
"""What the JSON API's statuses mean (it gives no error codes: see ``_answer``)."""


def _answer(exc: BaseException, what: str, bucket: str) -> CkptStoreError:
    status = int(getattr(exc, "code", 0) or 0)
    message = str(getattr(exc, "message", ""))
    missing = status == 404 and "specified bucket does not exist" in message.lower()  # GCS's
    return ANSWERS.error(
        what, bucket, code="NoSuchBucket" if missing else "", status=status, reason=message
    )


_broken = broken_rule((requests.exceptions.Timeout, TimeoutError, urllib3.exceptions.TimeoutError))


def _connection(exc: BaseException, what: str, bucket: str) -> CkptStoreError:
    """Refused before it left (retrying cannot duplicate it), or broken after."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return unreachable(what, exc, "GCS")
    reason: object = exc.args[0] if exc.args else None
    reason = getattr(reason, "reason", reason)  # urllib3's MaxRetryError wraps the cause
    if isinstance(
        reason, (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError)
    ):
        return unreachable(what, exc, "GCS")
    return _broken(exc, what, bucket)


_no_credentials = no_credentials(
    "no usable Google credentials (Application Default Credentials, credentials_file=, or "
    "token=anonymous for an emulator)"
)


_BROKEN = (
    storage_exceptions.DataCorruption,  # a checksum of the answer did not match
    requests.exceptions.RequestException,  # ReadTimeout, ChunkedEncodingError, ...
    urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError when requests lets them by
    http.client.HTTPException,  # IncompleteRead, RemoteDisconnected
    storage_exceptions.InvalidResponse,  # an upload/download answer the client could not use
)
"""Failures after the request may have reached the server: the exchange broke."""

GCS_RULES: Rules = (
    (api.GoogleAPICallError, _answer),
    (
        requests.exceptions.SSLError,
        lambda exc, what, _: StorageError(errno.EIO, f"{what}: TLS failed: {exc}"),
    ),
    ((requests.exceptions.ConnectTimeout, requests.exceptions.ConnectionError), _connection),
    ((auth_errors.DefaultCredentialsError, auth_errors.RefreshError), _no_credentials),
    (
        auth_errors.TransportError,
        lambda exc, what, _: TransientStorageError(errno.ECONNREFUSED, f"{what}: {exc}"),
    ),
    (_BROKEN, _broken),
    (
        auth_errors.GoogleAuthError,
        lambda exc, what, _: StorageAccessDeniedError(errno.EACCES, f"{what}: {exc}"),
    ),
    (OSError, _broken),  # a socket error no library wrapped
)
"""google-cloud-storage's, requests' and google-auth's exceptions, most specific first."""


@contextlib.contextmanager
def translate_gcs_errors(what: str, *, bucket: str) -> Iterator[None]:
    """Translate google-cloud-storage errors raised inside the block into ckptstore errors
    naming ``what``."""
    with translating(GCS_RULES, what, bucket):
        yield
