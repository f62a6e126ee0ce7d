"""The one place where azure-core's errors become ckptstore's (docs/backends/azure.md).

Throttling (503 ServerBusy), 5xx, 408 and timeouts are transient. A failure after which a write
may or may not have happened (a read timeout, a connection reset after the request was sent:
azure-core's ``ServiceResponseError``) is an ``IndeterminateOutcomeError``: the caller must read
back before deciding (I8). A request that never left (``ServiceRequestError``: connection
refused, DNS) is transient and safe to send again.

A failed create answers 409 ``BlobAlreadyExists`` on Azurite and 412 ``ConditionNotMet`` on
Azure (object_store #830): both are ``PreconditionFailedError``. A block list naming blocks that
are gone (400 ``InvalidBlockList``: garbage collection discarded an upload's uncommitted blocks)
is ``ObjectNotFoundError``, as S3's ``NoSuchUpload`` is.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
from collections.abc import Iterator

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
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

__all__ = ["translate_azure_errors"]

_NOT_FOUND = {"BlobNotFound", "ResourceNotFound", "InvalidBlockList", "BlockListTooLong"}
_EXISTS = {"BlobAlreadyExists", "ConditionNotMet", "TargetConditionNotMet"}
_DENIED = {
    "AuthenticationFailed",
    "AuthorizationFailure",
    "AuthorizationPermissionMismatch",
    "AuthorizationProtocolMismatch",
    "AuthorizationResourceTypeMismatch",
    "AuthorizationServiceMismatch",
    "AuthorizationSourceIPMismatch",
    "InsufficientAccountPermissions",
    "AccountIsDisabled",
    "NoAuthenticationInformation",
}
_TRANSIENT = {"ServerBusy", "OperationTimedOut", "InternalError", "IngressLimitExceeded"}


@contextlib.contextmanager
def translate_azure_errors(what: str, *, container: str) -> Iterator[None]:
    """Translate azure-core errors raised inside the block into ckptstore errors naming ``what``."""
    try:
        yield
    except CkptStoreError:
        raise  # translated already (a nested block)
    except ClientAuthenticationError as exc:  # 401/403, or a credential that got no token
        if exc.status_code:
            raise _from_response(exc, what, container) from exc
        raise StorageAccessDeniedError(
            errno.EACCES, f"{what}: no usable Azure credentials: {_first_line(exc)}"
        ) from exc
    except HttpResponseError as exc:
        raise _from_response(exc, what, container) from exc
    except ServiceRequestError as exc:
        raise TransientStorageError(
            errno.ECONNREFUSED, f"{what}: cannot reach the Azure Blob endpoint: {_first_line(exc)}"
        ) from exc
    except (ServiceResponseError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
        raise _broken(what, exc) from exc
    except AzureError as exc:  # a request the SDK refused to send, or a body that broke
        raise _broken(what, exc) from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0]


def _broken(what: str, exc: BaseException) -> IndeterminateOutcomeError:
    """The exchange broke after the request may have been sent: worth retrying where that is
    safe, and for a conditional write an unknown outcome to resolve by reading back (I8)."""
    text = str(exc).lower()
    code = errno.ETIMEDOUT if "timed out" in text or "timeout" in text else errno.ECONNRESET
    return IndeterminateOutcomeError(
        code,
        f"{what}: the connection broke ({_first_line(exc)}); the request may have taken effect",
    )


def _from_response(exc: HttpResponseError, what: str, container: str) -> CkptStoreError:
    raw = getattr(exc, "error_code", None)
    code = str(getattr(raw, "value", raw) or "")  # the SDK's StorageErrorCode, or a string
    status = int(exc.status_code or 0)
    reason = str(exc.message or getattr(exc, "reason", None) or "").strip().split("\n", 1)[0]
    message = f"{what}: {code or status}: {reason}".rstrip(": ")
    if code == "ContainerNotFound":
        return StoreNotFoundError(
            f"{what}: container {container!r} does not exist (ckptstore never creates "
            f"containers; create it, or check the account and endpoint)"
        )
    if code in _NOT_FOUND or status == 404:
        return ObjectNotFoundError(errno.ENOENT, message, http_status=status or None)
    if code in _EXISTS or status == 412:
        return PreconditionFailedError(message, http_status=status or 412)
    if code in _DENIED or status in (401, 403):
        return StorageAccessDeniedError(
            errno.EACCES,
            f"{message} (check the credentials and their permissions on {container!r})",
            http_status=status or None,
        )
    if code in _TRANSIENT or status >= 500 or status in (408, 429):
        return TransientStorageError(message, http_status=status or None)
    return StorageError(message, http_status=status or None)
