"""The one retry policy of the object-store drivers: what is retried, how often, how long apart.

Only ``TransientStorageError`` (and so ``IndeterminateOutcomeError``) is retried: a refusal, a
missing key or a denial never goes away by asking again. Attempts are bounded in number and in
time, spaced by exponential backoff with jitter. A call whose repetition is unsafe (a
conditional write) is never handed to this policy as is: the driver resolves its outcome first
(``ObjectStoreBase.resolve_create``), or sends it once.
"""

from __future__ import annotations

import logging

from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)
from tenacity.stop import stop_base

from ckptstore.errors import TransientStorageError

__all__ = ["bucket_check_policy", "retry_policy"]

log = logging.getLogger(__name__)


def retry_policy(
    max_attempts: int,
    *,
    max_delay_s: float | None = 60.0,
    max_wait_s: float = 5.0,
    name: str = "storage",
) -> Retrying:
    """Retry transient failures up to ``max_attempts`` tries (and ``max_delay_s`` seconds, if
    given), waiting 50 ms doubling up to ``max_wait_s``, plus up to 100 ms of jitter."""
    stop: stop_base = stop_after_attempt(max_attempts)
    if max_delay_s is not None:
        stop = stop | stop_after_delay(max_delay_s)
    return Retrying(
        retry=retry_if_exception_type(TransientStorageError),
        stop=stop,
        wait=wait_exponential(multiplier=0.05, max=max_wait_s) + wait_random(0, 0.1),
        reraise=True,
        before_sleep=lambda state: log.debug("retrying %s call: %s", name, state.outcome),
    )


def bucket_check_policy() -> Retrying:
    """Two tries, a fraction of a second apart: opening a store on a bucket that cannot be
    reached fails fast, and one dropped connection does not fail it."""
    return Retrying(
        retry=retry_if_exception_type(TransientStorageError),
        stop=stop_after_attempt(2),
        wait=wait_exponential(multiplier=0.2, max=1.0) + wait_random(0, 0.1),
        reraise=True,
    )
