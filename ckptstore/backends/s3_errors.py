"""The one place where botocore's errors become ckptstore's (docs/backends/s3.md).

Throttling, 5xx, timeouts and dropped connections are transient. A failure after which a
write may or may not have happened (a read timeout, a connection reset after the request was
sent) is an ``IndeterminateOutcomeError``: the caller must read back before deciding (I8).

botocore wraps most transport errors, but not all: a connection that breaks while botocore
reads a (non-streamed) answer raises urllib3's ``ProtocolError`` raw, and a body read can raise
``IncompleteReadError`` or ``http.client`` errors. Every one of them has a row here, so no
third-party exception crosses the driver boundary.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
from collections.abc import Iterator
from typing import TYPE_CHECKING

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

from ckptstore.backends.error_table import (
    AnswerTable,
    broken_rule,
    no_credentials,
    translating,
    unreachable,
)
from ckptstore.errors import CkptStoreError, StorageError

if TYPE_CHECKING:
    from ckptstore.backends.error_table import Rules

__all__ = ["S3_RULES", "translate_s3_errors"]

ANSWERS = AnswerTable(
    not_found=frozenset({"NoSuchKey", "NotFound", "404", "NoSuchVersion", "NoSuchUpload"}),
    denied=frozenset(
        {
            "AccessDenied",
            "403",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
            "AllAccessDisabled",
        }
    ),
    denied_statuses=frozenset({403}),
    transient=frozenset(
        {
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
    ),
    transient_statuses=frozenset({409}),
)
"""What S3's error codes mean."""


def _answer(exc: BaseException, what: str, bucket: str) -> CkptStoreError:
    response = getattr(exc, "response", {})
    error = response.get("Error", {})
    return ANSWERS.error(
        what,
        bucket,
        code=str(error.get("Code", "")),
        status=int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0),
        reason=str(error.get("Message", "")),
    )


_broken = broken_rule((ReadTimeoutError, TimeoutError, urllib3.exceptions.TimeoutError))


def _tls(exc: BaseException, what: str, bucket: str) -> CkptStoreError:
    """A certificate problem does not go away when retried; another TLS failure might."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate verify failed" in str(exc):
        return StorageError(errno.EIO, f"{what}: TLS certificate refused: {exc}")
    return _broken(exc, what, bucket)


_no_credentials = no_credentials(
    "no AWS credentials found (environment, ~/.aws, instance role, or the "
    "aws_access_key_id/aws_secret_access_key options)"
)


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


def _refused_to_send(exc: BaseException, what: str, _bucket: str) -> CkptStoreError:
    """A request botocore refused to send (bad parameters, config)."""
    return StorageError(errno.EIO, f"{what}: {exc}")


S3_RULES: Rules = (
    (ClientError, _answer),
    (_NOT_SENT, lambda exc, what, _: unreachable(what, exc, "S3")),
    (SSLError, _tls),
    (_BROKEN, _broken),
    ((NoCredentialsError, PartialCredentialsError), _no_credentials),
    (BotoCoreError, _refused_to_send),
    (OSError, _broken),  # a socket error no library wrapped
)
"""botocore's exceptions, most specific first."""


@contextlib.contextmanager
def translate_s3_errors(what: str, *, bucket: str) -> Iterator[None]:
    """Translate botocore errors raised inside the block into ckptstore errors naming ``what``."""
    with translating(S3_RULES, what, bucket):
        yield
