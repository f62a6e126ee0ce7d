"""A storage failure is not a verdict: the storage's own errors, told apart from violations.

Each case of the suite ends in one of three outcomes: its invariants held; one was violated;
or the storage under test kept failing (a 5xx, a reset connection, a timeout, EIO, after the
driver's own retries), so that the case proved nothing either way. Such a case is run again,
at most ``CASE_ATTEMPTS`` times; if the storage still fails it, it is reported as a
``storage error``: never as a pass (nothing was checked) and never as a violation (the
protocol did nothing wrong).

A fourth outcome is the suite's own: a wait that timed out, a step the suite could not carry
out, a Python error in its code (``SuiteError``). It says nothing about the protocol or the
storage: the layer's invariants are "not checked (the suite failed)", with the traceback, and
the run does not pass.

What is *not* a storage failure: a fault the suite injected, and anything raised because of
one (``InjectedFault`` in the chain of causes); a simulated crash; and the storage's definite
answers (not found, exists, precondition failed), which the protocol must handle, so that one
escaping a case is judged as before, by the invariant it breaks.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from hypothesis.errors import HypothesisException

from ckptstore.conformance.faults import InjectedFault
from ckptstore.conformance.model import InvariantViolation
from ckptstore.errors import (
    CapabilityError,
    CkptStoreError,
    InvalidInputError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TargetExistsError,
)

__all__ = [
    "CASE_ATTEMPTS",
    "REFUSES",
    "STORAGE_ERROR",
    "SUITE_ERROR",
    "StorageFailure",
    "StorageRefused",
    "SuiteError",
    "abort_on_storage_failure",
    "refusal",
    "retry_storage_failures",
    "storage_failure",
    "suite_failed",
]

STORAGE_ERROR = "storage error"
SUITE_ERROR = "suite error"
REFUSES = "the store refuses this storage"
"""How a refusal (``refusal``) reads in the report: invariants not applicable, with it."""
CASE_ATTEMPTS = 3
"""Runs of one case (the first and two retries) before the storage's failure is reported."""
RETRY_PAUSE_S = 0.5
"""Pause before the n-th retry, times n: a server that answers 500 under load gets a rest."""

_ANSWERS = (ObjectNotFoundError, PreconditionFailedError, TargetExistsError)
T = TypeVar("T")
P = ParamSpec("P")


class StorageFailure(BaseException):
    """The storage under test failed a case, which is therefore undecided.

    A BaseException, as ``SimulatedCrash`` is: hypothesis stops at once instead of shrinking
    (and then flaking on) a server's error as if it were a failing example.
    """

    def __init__(self, error: StorageError, *, runs: int = 1) -> None:
        every = f" (the storage failed all {runs} runs)" if runs > 1 else ""
        super().__init__(f"{STORAGE_ERROR}, not an invariant violation{every}: {error!r}")
        self.error = error


class SuiteError(BaseException):
    """The suite could not carry a case out (a wait that timed out, a state it could not
    reach): no verdict on the protocol nor on the storage.

    A BaseException, as ``StorageFailure`` is: hypothesis stops at once instead of shrinking a
    timeout, and no layer's ``except Exception`` takes it for the protocol's error.
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"{SUITE_ERROR}, not an invariant violation: {message}")
        self.message = message


class StorageRefused(BaseException):
    """The store refused the storage under test mid-case (``CapabilityError``: a versioned
    store on a bucket without versioning answers its first save so): the invariants the case
    checks are not applicable there, with the refusal as the reason; the probes say which
    capability is missing. A BaseException, so that hypothesis stops at once."""

    def __init__(self, error: CapabilityError) -> None:
        super().__init__(f"{REFUSES}: {error}")
        self.error = error


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and its explicit causes (``raise ... from``), outermost first, each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__


def refusal(error: BaseException) -> CapabilityError | None:
    """The ``CapabilityError`` that ``error`` comes from (itself, or an explicit cause), or
    None: a case that failed because the store refused the storage."""
    for current in _causes(error):
        if isinstance(current, StorageRefused):
            return current.error
        if isinstance(current, CapabilityError):
            return current
        if isinstance(current, InjectedFault):
            return None
    return None


def storage_failure(error: BaseException) -> StorageError | None:
    """The failure of the storage under test that ``error`` comes from, or None.

    Follows the explicit causes (``raise ... from``): the deepest ``StorageError`` is where the
    trouble began. It is a storage failure unless it is a definite answer about the data, or an
    injected fault is in the chain.
    """
    deepest: StorageError | None = None
    for current in _causes(error):
        if isinstance(current, StorageFailure):
            return current.error
        if isinstance(current, InjectedFault):
            return None
        if isinstance(current, StorageError):
            deepest = current
    if deepest is None or isinstance(deepest, _ANSWERS):
        return None
    return deepest


def suite_failed(error: BaseException) -> bool:
    """Whether ``error``, escaping a case, is the suite's own failure rather than the answer
    of the system under test: a ``SuiteError``; a barrier broken by a timeout; hypothesis's
    own error (a flaky example); an argument ckptstore refused as malformed (the suite passed
    it); or a Python error raised in the suite's code. A Python error raised in a driver (a
    third party's ``KeyError``, an SDK's exception) is the system's, as ckptstore's own
    errors are: judged, not excused."""
    if isinstance(error, SuiteError | threading.BrokenBarrierError | HypothesisException):
        return True
    if isinstance(error, InvariantViolation | StorageFailure | InjectedFault):
        return False
    if isinstance(error, CkptStoreError):
        return isinstance(error, InvalidInputError)
    return _raised_in_the_suite(error)


_SUITE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple(
    os.path.abspath(path) + os.sep
    for path in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def _raised_in_the_suite(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback outside the standard library is
    the suite's code (``max()`` of an empty listing in a layer), not a driver's."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(_STDLIB_DIRS):
            continue
        return path.startswith(_SUITE_DIR)
    return True


def abort_on_storage_failure(function: Callable[P, T]) -> Callable[P, T]:
    """``function``, raising ``StorageFailure`` where the storage failed it (a rule of the state
    machine: the example stops there, undecided, instead of being judged or shrunk)."""

    @functools.wraps(function)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            refused = refusal(exc)
            if refused is not None:
                raise StorageRefused(refused) from exc
            failure = storage_failure(exc)
            if failure is None:
                raise
            raise StorageFailure(failure) from exc

    return guarded


def retry_storage_failures(
    run_once: Callable[[], T], failed: Callable[[T], bool], *, attempts: int = CASE_ATTEMPTS
) -> tuple[T, int]:
    """Run a case until it is not ``failed`` by the storage, at most ``attempts`` times.

    Returns the last outcome and how many runs were retried. A run must start afresh (a new
    location): nothing of a failed run is reused.
    """
    outcome = run_once()
    retries = 0
    while failed(outcome) and retries + 1 < attempts:
        retries += 1
        time.sleep(RETRY_PAUSE_S * retries)
        outcome = run_once()
    return outcome, retries
