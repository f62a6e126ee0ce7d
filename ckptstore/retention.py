"""Retention policies decide which published checkpoints to keep; they compose with | and &.

``KeepLast(3) | KeepEvery(1000)`` keeps the three newest and every thousandth step;
``KeepLast(10) & KeepNewerThan(timedelta(days=2))`` keeps at most ten, none older than two
days. Whatever a policy says, the store never deletes the newest checkpoint (I3), and applies
retention only after a publish succeeded.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from ckptstore.errors import InvalidOptionError

__all__ = [
    "AllOf",
    "AnyOf",
    "CheckpointAge",
    "KeepEvery",
    "KeepLast",
    "KeepNewerThan",
    "RetentionPolicy",
]


@dataclass(frozen=True)
class CheckpointAge:
    """What a policy may judge: a step and when it was committed (None if unreadable)."""

    step: int
    committed_at: datetime | None


class RetentionPolicy(abc.ABC):
    """Chooses the steps to keep among the published ones (ascending)."""

    needs_times: bool = False

    @abc.abstractmethod
    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        """Return the steps this policy keeps."""

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        return AnyOf(self, other)

    def __and__(self, other: RetentionPolicy) -> RetentionPolicy:
        return AllOf(self, other)


class AnyOf(RetentionPolicy):
    """Keep what any of the policies keeps."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies = policies
        self.needs_times = any(p.needs_times for p in policies)

    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        return set().union(*(p.keep(checkpoints, now) for p in self.policies))

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


class AllOf(RetentionPolicy):
    """Keep only what every one of the policies keeps."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies = policies
        self.needs_times = any(p.needs_times for p in policies)

    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        kept = [p.keep(checkpoints, now) for p in self.policies]
        return set.intersection(*kept) if kept else set()

    def __repr__(self) -> str:
        return "(" + " & ".join(map(repr, self.policies)) + ")"


def _positive_int(policy: str, value: object) -> int:
    """``value`` if it is an int of at least 1; InvalidOptionError, naming ``policy``, if not."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(f"{policy} needs a positive int, got {value!r}")
    return value


class KeepLast(RetentionPolicy):
    """Keep the ``n`` newest checkpoints."""

    def __init__(self, n: int) -> None:
        self.n = _positive_int("KeepLast", n)

    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        return {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-self.n :]}

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose step is a multiple of ``k`` (milestones)."""

    def __init__(self, k: int) -> None:
        self.k = _positive_int("KeepEvery", k)

    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.k == 0}

    def __repr__(self) -> str:
        return f"KeepEvery({self.k})"


class KeepNewerThan(RetentionPolicy):
    """Keep checkpoints committed less than ``age`` ago (and any whose time is unreadable)."""

    needs_times = True

    def __init__(self, age: timedelta | float) -> None:
        seconds = age.total_seconds() if isinstance(age, timedelta) else float(age)
        if not seconds > 0:
            raise InvalidOptionError(f"KeepNewerThan needs a positive duration, got {age!r}")
        self.age = timedelta(seconds=seconds)

    def keep(self, checkpoints: Sequence[CheckpointAge], now: datetime) -> set[int]:
        cutoff = now.astimezone(timezone.utc) - self.age
        return {c.step for c in checkpoints if c.committed_at is None or c.committed_at >= cutoff}

    def __repr__(self) -> str:
        return f"KeepNewerThan({self.age})"
