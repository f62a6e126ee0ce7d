"""The one place where botocore's errors become ckptstore's (DESIGN §10).

Throttling, 5xx, timeouts and dropped connections are transient. A failure after which a
write may or may not have happened (a read timeout, a connection reset after the request was
sent) is an ``IndeterminateOutcomeError``: the caller must read back before deciding (I8).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
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
    except ClientError as exc:
        raise _from_client_error(exc, what, bucket) from exc
    except (ReadTimeoutError, ConnectionClosedError) as exc:
        raise IndeterminateOutcomeError(
            errno.ETIMEDOUT, f"{what}: no answer ({exc}); the request may have taken effect"
        ) from exc
    except (EndpointConnectionError, ConnectTimeoutError) as exc:
        raise TransientStorageError(
            errno.ECONNREFUSED, f"{what}: cannot reach the S3 endpoint: {exc}"
        ) from exc
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise StorageAccessDeniedError(
            errno.EACCES,
            f"{what}: no AWS credentials found (environment, ~/.aws, instance role, or the "
            f"aws_access_key_id/aws_secret_access_key options): {exc}",
        ) from exc
    except BotoCoreError as exc:
        raise StorageError(errno.EIO, f"{what}: {exc}") from exc


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
        return ObjectNotFoundError(errno.ENOENT, message)
    if code == "PreconditionFailed" or status == 412:
        return PreconditionFailedError(412, message)
    if code in _DENIED or status == 403:
        return StorageAccessDeniedError(
            errno.EACCES, f"{message} (check the credentials and their permissions on {bucket!r})"
        )
    if code in _TRANSIENT or status >= 500 or status == 409:
        return TransientStorageError(status or errno.EAGAIN, message)
    return StorageError(status or errno.EIO, message)
