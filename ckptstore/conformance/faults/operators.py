"""An operator's delete, rollback or retention, run while a trainer resumes: at any storage call
of its ``latest()`` and of the reads that follow.

``race_a_reader`` opens a reader's store whose driver runs the operator's action (through a
store of its own, as another process would) just before the reader's storage call number
``at``; past the reader's last call, the action runs after it. It then judges what the reader
got against what was published before and after the action (docs/protocol.md §5.3):

- ``latest()`` returns None only if no checkpoint stayed published (I4), never a step older
  than one that stayed published throughout (I4), never a stray (I1);
- it reports damage only where there is some: a deletion racing a read is passed over, or is
  ``CheckpointNotFoundError`` for a shard read, never an integrity error (I1);
- whatever it returns reads back as saved, unless the action deleted it meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptstore.conformance.model import InvariantViolation, Model
from ckptstore.driver import driver_family, storage_calls
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    RefusedError,
    StorageError,
)
from ckptstore.retention import KeepLast
from ckptstore.store import Store

__all__ = ["CallHook", "OperatorAction", "race_a_reader"]


class CallHook:
    """A driver that forwards every call to ``inner``, and runs ``action`` once, just before
    the call numbered ``at`` (from 0)."""

    def __init__(self, inner: Any, at: int, action: Callable[[], None]) -> None:
        self._inner = inner
        self._calls = storage_calls(inner)
        self.family = driver_family(inner)
        self.at = at
        self.count = 0
        self.where: str | None = None
        """Where the action ran: before which call (None: not yet)."""
        self._action = action

    @property
    def inner(self) -> Any:
        """The wrapped driver."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self._calls:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.count == self.at:
                shown = ", ".join(str(a)[:60] for a in args if isinstance(a, (str, int)))
                self.run(f"before the reader's storage call {self.at} ({name}({shown}))")
            self.count += 1
            return attribute(*args, **kwargs)

        return call

    def run(self, where: str) -> None:
        """Run the action now, unless it ran already."""
        if self.where is None:
            self.where = where
            self._action()


@dataclass
class OperatorAction:
    """What an operator does to a store: ``delete`` (``--force``) a step, ``rollback`` to a
    step, or apply ``retention`` keeping the newest ``keep``."""

    kind: str
    step: int = 0
    keep: int = 1
    error: CkptStoreError | None = None
    took_epoch: bool = False
    """Whether a rollback took an epoch (a takeover from ``step``, docs/protocol.md §6)."""

    def __str__(self) -> str:
        if self.kind == "retention":
            return f"retention KeepLast({self.keep})"
        return f"{self.kind} {self.step}"

    def doomed(self, published: list[int]) -> set[int]:
        """The steps of ``published`` (ascending) that the action may remove (a rollback:
        from the history, at the instant of its takeover)."""
        if self.kind == "rollback":
            return {s for s in published if s > self.step}
        if self.kind == "retention":
            return set(published[: -self.keep])
        if self.kind == "delete" and published and self.step == published[-1]:
            return set()  # the newest needs --force: refused
        return {self.step}

    def run(self, store: Store) -> None:
        """Do it through ``store``; keep (not raise) what ckptstore refused or failed with."""
        try:
            if self.kind == "rollback":
                done = store.rollback(self.step)
                self.took_epoch = getattr(done, "epoch", None) is not None
            elif self.kind == "retention":
                store.apply_retention(KeepLast(self.keep))
            else:
                store.delete(self.step, force=self.kind == "delete --force")
        except CkptStoreError as exc:
            self.error = exc


def race_a_reader(
    reader_strategy: Any,
    operator: Store,
    action: OperatorAction,
    at: int,
    model: Model,
    clock: Callable[[], float],
) -> None:
    """Run ``action`` at the reader's storage call ``at``; raise InvariantViolation if what the
    reader got is wrong, StorageError if the storage failed either of them."""
    published = sorted(model.committed)
    doomed = action.doomed(published)
    model.removal_started(doomed, explicit=action.kind != "retention")
    stayed = [s for s in published if s not in doomed]
    hook = CallHook(reader_strategy.driver, at, lambda: action.run(operator))
    reader = Store(reader_strategy.with_driver(hook), clock=clock)
    context = _Context(action, hook, model, stayed)
    try:
        checkpoint = reader.latest()
    except IntegrityError as exc:
        hook.run("after the reader's last storage call")
        context.check_operator()
        if not context.damage():
            context.fail("I1", f"latest() reported damage where there is none: {exc}")
        return
    except StorageError:
        raise
    except CkptStoreError as exc:
        hook.run("after the reader's last storage call")
        context.check_operator()
        context.fail("I4", f"latest() failed: {exc!r}")
    if checkpoint is None:
        hook.run("after the reader's last storage call")
        context.check_operator()
        if stayed:
            context.fail("I4", f"latest() returned None; step {stayed[-1]} stayed published")
        return
    if checkpoint.step in model.strays:
        context.fail("I1", f"latest() returned {model.strays[checkpoint.step]}")
    if stayed and checkpoint.step < stayed[-1]:
        context.fail(
            "I4", f"latest() returned step {checkpoint.step}; step {stayed[-1]} stayed published"
        )
    context.read_back(checkpoint)
    hook.run("after the reader's last storage call")
    context.check_operator()


@dataclass
class _Context:
    action: OperatorAction
    hook: CallHook
    model: Model
    stayed: list[int]

    def fail(self, invariant: str, message: str) -> None:
        where = self.hook.where or "not yet"
        raise InvariantViolation(invariant, f"{message} (an operator's {self.action} ran {where})")

    def damage(self) -> bool:
        """Whether the store holds damage the reader may rightly report."""
        newest = self.stayed[-1] if self.stayed else None
        return bool(self.model.corrupted) or self.model.damage_above(newest)

    def check_operator(self) -> None:
        """The operator's own outcome: a delete of the newest without --force is refused, and
        a rollback to a damaged checkpoint; anything else it raised is raised here."""
        error = self.action.error
        if error is None:
            return
        if isinstance(error, RefusedError) and self.action.kind == "delete":
            return
        damaged = self.model.corrupted.get(self.action.step)
        if isinstance(error, IntegrityError) and self.action.kind == "rollback" and damaged:
            return
        raise error

    def read_back(self, checkpoint: Any) -> None:
        saved = self.model.committed.get(checkpoint.step)
        damaged = self.model.corrupted.get(checkpoint.step, {})
        for name in checkpoint.names:
            try:
                data = checkpoint.read(name)
            except CheckpointNotFoundError:
                return  # deleted meanwhile: whether it could be, the model's check judges
            except IntegrityError as exc:
                if name in damaged:
                    continue
                self.fail(
                    "I1",
                    f"reading step {checkpoint.step} reported damage where there is none "
                    f"(a deletion racing a read is CheckpointNotFoundError): {exc}",
                )
            else:
                if saved is not None and name not in damaged and data != saved.shards.get(name):
                    self.fail("I1", f"step {checkpoint.step} shard {name!r} read back other bytes")
