"""The one place where botocore's errors become ckptstore's (docs/backends/s3.md).

Throttling, 5xx, timeouts and dropped connections are transient. A failure after which a
write may or may not have happened (a read timeout, a connection reset after the request was
sent) is an ``IndeterminateOutcomeError``: the caller must read back before deciding (I8).

botocore wraps most transport errors, but not all: a connection that breaks while botocore
reads a (non-streamed) answer raises urllib3's ``ProtocolError`` raw, and a body read can raise
``IncompleteReadError`` or ``http.client`` errors. Every one of them is translated here, so
no third-party exception crosses the driver boundary.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
from collections.abc import Iterator

import urllib3.exceptions
from botocore.exceptions import (
    BotoCoreError,
    ChecksumError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProxyConnectionError,
    ReadTimeoutError,
    SSLError,
)

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

__all__ = ["translate_s3_errors"]

_NOT_FOUND = {"NoSuchKey", "NotFound", "404", "NoSuchVersion", "NoSuchUpload"}
_DENIED = {
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
}
_TRANSIENT = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "ConditionalRequestConflict",
    "OperationAborted",
    "500",
    "502",
    "503",
    "504",
}


@contextlib.contextmanager
def translate_s3_errors(what: str, *, bucket: str) -> Iterator[None]:
    """Translate botocore errors raised inside the block into ckptstore errors naming ``what``."""
    try:
        yield
    except CkptStoreError:
        raise  # translated already (a nested block): an OSError subclass, but not a transport's
    except ClientError as exc:
        raise _from_client_error(exc, what, bucket) from exc
    except _NOT_SENT as exc:
        raise TransientStorageError(
            errno.ECONNREFUSED, f"{what}: cannot reach the S3 endpoint: {exc}"
        ) from exc
    except SSLError as exc:  # a certificate problem does not go away when retried
        if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate verify failed" in str(exc):
            raise StorageError(errno.EIO, f"{what}: TLS certificate refused: {exc}") from exc
        raise _broken(what, exc) from exc
    except _BROKEN as exc:
        raise _broken(what, exc) from exc
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StorageAccessDeniedError(
            errno.EACCES,
            f"{what}: no AWS credentials found (environment, ~/.aws, instance role, or the "
            f"aws_access_key_id/aws_secret_access_key options): {exc}",
        ) from exc
    except BotoCoreError as exc:  # a request botocore refused to send (bad parameters, config)
        raise StorageError(errno.EIO, f"{what}: {exc}") from exc
    except OSError as exc:  # a socket error no library wrapped
        raise _broken(what, exc) from exc


_NOT_SENT = (
    EndpointConnectionError,
    ConnectTimeoutError,
    ProxyConnectionError,
    urllib3.exceptions.ConnectTimeoutError,  # urllib3's NewConnectionError too
)
"""Failures before the request left: retrying cannot duplicate it."""

_BROKEN = (
    HTTPClientError,  # botocore's ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    IncompleteReadError,  # a body shorter than its Content-Length
    ChecksumError,  # an answer damaged in transit
    FlexibleChecksumError,
    urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError... when botocore lets them by
    http.client.HTTPException,  # IncompleteRead, RemoteDisconnected, BadStatusLine
)
"""Failures after the request may have reached the server: the exchange broke."""


def _broken(what: str, exc: BaseException) -> IndeterminateOutcomeError:
    """The exchange broke after the request may have been sent: worth retrying where that is
    safe, and for a conditional write an unknown outcome to resolve by reading back (I8)."""
    timeout = isinstance(exc, (ReadTimeoutError, TimeoutError, urllib3.exceptions.TimeoutError))
    code = errno.ETIMEDOUT if timeout else errno.ECONNRESET
    return IndeterminateOutcomeError(
        code, f"{what}: the connection broke ({exc}); the request may have taken effect"
    )


def _from_client_error(exc: ClientError, what: str, bucket: str) -> CkptStoreError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    message = f"{what}: {code or status}: {error.get('Message', '')}".rstrip(": ")
    if code == "NoSuchBucket":
        return StoreNotFoundError(
            f"{what}: bucket {bucket!r} does not exist (ckptstore never creates buckets)"
        )
    if code in _NOT_FOUND or status == 404:
        return ObjectNotFoundError(errno.ENOENT, message, http_status=status or None)
    if code == "PreconditionFailed" or status == 412:
        return PreconditionFailedError(message, http_status=status or 412)
    if code in _DENIED or status == 403:
        return StorageAccessDeniedError(
            errno.EACCES,
            f"{message} (check the credentials and their permissions on {bucket!r})",
            http_status=status or None,
        )
    if code in _TRANSIENT or status >= 500 or status == 409:
        return TransientStorageError(message, http_status=status or None)
    return StorageError(message, http_status=status or None)
