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
from typing import TYPE_CHECKING

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)

from ckptstore.backends.error_table import AnswerTable, broken, first_line, translating, unreachable
from ckptstore.errors import CkptStoreError, StorageAccessDeniedError

if TYPE_CHECKING:
    from ckptstore.backends.error_table import Rules

__all__ = ["AZURE_RULES", "translate_azure_errors"]

ANSWERS = AnswerTable(
    store_missing=(
        "{what}: container {store!r} does not exist (ckptstore never creates containers; "
        "create it, or check the account and endpoint)"
    ),
    store_missing_codes=frozenset({"ContainerNotFound"}),
    not_found=frozenset(
        {"BlobNotFound", "ResourceNotFound", "InvalidBlockList", "BlockListTooLong"}
    ),
    refused=frozenset({"BlobAlreadyExists", "ConditionNotMet", "TargetConditionNotMet"}),
    denied=frozenset(
        {
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
    ),
    transient=frozenset(
        {"ServerBusy", "OperationTimedOut", "InternalError", "IngressLimitExceeded"}
    ),
)
"""What Azure Blob's error codes mean."""


def _answer(exc: BaseException, what: str, container: str) -> CkptStoreError:
    raw = getattr(exc, "error_code", None)
    reason = getattr(exc, "message", None) or getattr(exc, "reason", None) or ""
    return ANSWERS.error(
        what,
        container,
        code=str(getattr(raw, "value", raw) or ""),  # the SDK's StorageErrorCode, or a string
        status=int(getattr(exc, "status_code", 0) or 0),
        reason=str(reason).strip().split("\n", 1)[0],
    )


def _authentication(exc: BaseException, what: str, container: str) -> CkptStoreError:
    """401/403, or a credential that got no token (no status)."""
    if getattr(exc, "status_code", None):
        return _answer(exc, what, container)
    return StorageAccessDeniedError(
        errno.EACCES, f"{what}: no usable Azure credentials: {first_line(exc)}"
    )


def _broken(exc: BaseException, what: str, _container: str) -> CkptStoreError:
    text = str(exc).lower()
    return broken(what, exc, timeout="timed out" in text or "timeout" in text)


AZURE_RULES: Rules = (
    (ClientAuthenticationError, _authentication),
    (HttpResponseError, _answer),
    (ServiceRequestError, lambda exc, what, _: unreachable(what, exc, "Azure Blob")),
    ((ServiceResponseError, http.client.HTTPException, ConnectionError, TimeoutError), _broken),
    (AzureError, _broken),  # a request the SDK refused to send, or a body that broke
)
"""azure-core's exceptions, most specific first."""


@contextlib.contextmanager
def translate_azure_errors(what: str, *, container: str) -> Iterator[None]:
    """Translate azure-core errors raised inside the block into ckptstore errors naming ``what``."""
    with translating(AZURE_RULES, what, container):
        yield
