"""Storage errors become ckptstore's by table: one row per kind of exception, one table per SDK.

Each object-store driver's ``*_errors`` module holds only what its SDK makes different: which
exception classes mean what (its ``Rules``) and which error codes its service answers (its
``AnswerTable``). Everything else is here, once:

- an answer (an HTTP status and an error code) is a missing store, a missing object, a refused
  precondition, a denial, a transient failure, or any other ``StorageError``, in that order;
- a failure before the request left (refused, unresolvable, connect timeout) is transient and
  safe to send again;
- a failure after the request may have reached the server is an ``IndeterminateOutcomeError``:
  retried where that is safe, read back where it is not (I8) (``broken_rule``: which of an
  SDK's exceptions are timeouts);
- an SDK that finds no credentials is denied access, saying where they are looked for
  (``no_credentials``).

No third-party exception crosses the driver boundary that a row names; every translation is
chained (``raise ... from exc``) and keeps the built-in meanings (``ObjectNotFoundError`` is a
``FileNotFoundError``).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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
from ckptstore.redaction import redact

__all__ = [
    "BUCKET_MISSING",
    "AnswerTable",
    "Rules",
    "broken",
    "broken_rule",
    "first_line",
    "naming",
    "no_credentials",
    "translating",
    "unreachable",
]

Translate = Callable[[BaseException, str, str], CkptStoreError]
"""Make the ckptstore error of an exception, given what was being done and the store's name."""
Rules = Sequence[tuple[type[BaseException] | tuple[type[BaseException], ...], Translate]]
"""Rows of (exception classes, translation), tried in order: the first row that matches wins."""
BUCKET_MISSING = "{what}: bucket {store!r} does not exist (ckptstore never creates buckets)"
"""The message of a missing bucket (``AnswerTable.store_missing``)."""


@contextlib.contextmanager
def translating(rules: Rules, what: str, store: str) -> Iterator[None]:
    """Translate the exceptions raised inside the block by the first of ``rules`` that
    matches; an exception no row matches goes through unchanged."""
    try:
        yield
    except CkptStoreError:
        raise  # translated already (a nested block): an OSError subclass, but not a transport's
    except Exception as exc:
        for kinds, translate in rules:
            if isinstance(exc, kinds):
                raise translate(exc, what, store) from exc
        raise


@contextlib.contextmanager
def naming(url: str, key: str | None = None) -> Iterator[None]:
    """A ckptstore error raised inside the block names the store's ``url`` (redacted) and the
    object's ``key`` where it names neither already (``CkptStoreError.url``, ``.key``)."""
    try:
        yield
    except CkptStoreError as error:
        if error.url is None:
            error.url = redact(url)
        if error.key is None and key is not None:
            error.key = key
        raise


@dataclass(frozen=True)
class AnswerTable:
    """What one service's error answers mean: its error codes, then the HTTP status."""

    store_missing: str = BUCKET_MISSING
    """The message of a missing bucket or container, formatted with ``what`` and ``store``."""
    store_missing_codes: frozenset[str] = frozenset({"NoSuchBucket"})
    not_found: frozenset[str] = frozenset()
    refused: frozenset[str] = frozenset({"PreconditionFailed"})
    """Codes of a precondition that did not hold (besides any 412)."""
    denied: frozenset[str] = frozenset()
    denied_statuses: frozenset[int] = frozenset({401, 403})
    transient: frozenset[str] = frozenset()
    transient_statuses: frozenset[int] = frozenset({408, 429})
    """Statuses below 500 that are worth retrying (every 5xx is)."""

    def error(
        self, what: str, store: str, *, code: str, status: int, reason: str
    ) -> CkptStoreError:
        """The ckptstore error of one error answer."""
        message = f"{what}: {code or status}: {reason}".rstrip(": ")
        if code in self.store_missing_codes:
            return StoreNotFoundError(self.store_missing.format(what=what, store=store))
        if code in self.not_found or status == 404:
            return ObjectNotFoundError(errno.ENOENT, message, http_status=status or None)
        if code in self.refused or status == 412:
            return PreconditionFailedError(message, http_status=status or 412)
        if code in self.denied or status in self.denied_statuses:
            return StorageAccessDeniedError(
                errno.EACCES,
                f"{message} (check the credentials and their permissions on {store!r})",
                http_status=status or None,
            )
        if code in self.transient or status >= 500 or status in self.transient_statuses:
            return TransientStorageError(message, http_status=status or None)
        return StorageError(message, http_status=status or None)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (SDKs append whole responses)."""
    return str(exc).strip().split("\n", 1)[0]


def broken(what: str, exc: BaseException, *, timeout: bool) -> IndeterminateOutcomeError:
    """The exchange broke after the request may have been sent: worth retrying where that is
    safe, and for a conditional write an unknown outcome to resolve by reading back (I8)."""
    return IndeterminateOutcomeError(
        errno.ETIMEDOUT if timeout else errno.ECONNRESET,
        f"{what}: the connection broke ({first_line(exc)}); the request may have taken effect",
    )


def broken_rule(timeouts: tuple[type[BaseException], ...]) -> Translate:
    """The translation of an exchange that broke (``broken``); one of ``timeouts`` timed out."""
    return lambda exc, what, _store: broken(what, exc, timeout=isinstance(exc, timeouts))


def no_credentials(missing: str) -> Translate:
    """The translation of an SDK's failure to find credentials: a denial saying ``missing``
    (which credentials, and where they are looked for)."""
    return lambda exc, what, _store: StorageAccessDeniedError(
        errno.EACCES, f"{what}: {missing}: {exc}"
    )


def unreachable(what: str, exc: BaseException, endpoint: str) -> TransientStorageError:
    """The request never left (connection refused, unresolvable, connect timeout): retrying
    cannot duplicate it."""
    return TransientStorageError(
        errno.ECONNREFUSED, f"{what}: cannot reach the {endpoint} endpoint: {first_line(exc)}"
    )
