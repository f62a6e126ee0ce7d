"""State-machine rules for a store shared with people: foreign entries and racing operators.

``ForeignEntryRules`` is a group of rules that ``make_state_machine`` mixes into its machine:

- ``plant_a_stray``: an entry the protocol did not make, named like a step the suite never
  saves (``faults.strays``): an empty directory, a file, a partial copy without a manifest, odd
  digits, a directory or a FIFO where a manifest belongs; on object stores the same as keys
  and "directory marker" keys. The model is told, so a stray taken for a checkpoint is I1;
- ``plant_a_pointer``: a corrupt LATEST pointer (bytes that are no step, a step past every
  checkpoint, one never published, a directory, a FIFO), which the protocol must ignore;
- ``operator_deletes_under_a_reader`` (with and without ``--force``), ``..._rolls_back_...``,
  ``..._applies_retention_...``: an operator's action at any storage call of a resuming
  trainer's ``latest()`` and reads (``faults.operators``).

After every step: no planted entry is gone or changed (I7: "entries the protocol did not make
are never removed"), and no reader blocked on a planted FIFO (I4: a resume that never
returns).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ckptstore.conformance.faults.operators import OperatorAction, race_a_reader
from ckptstore.conformance.faults.strays import (
    FILE_SYSTEM_KINDS,
    OBJECT_STORE_KINDS,
    POINTER_KINDS,
    FifoGuard,
    Stray,
    disturbed,
    fifo_paths,
    plant,
    plant_pointer,
)
from ckptstore.conformance.location import Location
from ckptstore.conformance.model import InvariantViolation, Model
from ckptstore.conformance.outcomes import abort_on_storage_failure
from ckptstore.driver import DriverFamily, driver_family
from ckptstore.names import MAX_STEP
from ckptstore.store import Store

__all__ = ["ForeignEntryRules"]


class ForeignEntryRules(RuleBasedStateMachine):
    """Rules that plant foreign entries and race operators against readers (see the module)."""

    location: Location
    model: Model
    store: Store
    next_step: int

    def __init__(self) -> None:
        super().__init__()
        self.planted: list[Stray] = []
        self.fifo_guard = FifoGuard()

    def _reserve_step(self) -> int:
        """A step the suite will never save (the next one, skipped)."""
        step = self.next_step
        self.next_step += 1
        return step

    def _remember(self, stray: Stray) -> None:
        self.location.changed()  # planted behind the store's back: the next check looks
        self.planted.append(stray)
        self.location.strays.append(stray)
        for path in fifo_paths(self.location, stray):
            self.fifo_guard.watch(path)

    @rule(data=st.data(), largest=st.booleans())
    @abort_on_storage_failure
    def plant_a_stray(self, data: Any, largest: bool) -> None:
        file_system = driver_family(self.location.base.driver) is DriverFamily.FILE_SYSTEM
        kind = data.draw(st.sampled_from(FILE_SYSTEM_KINDS if file_system else OBJECT_STORE_KINDS))
        step = MAX_STEP if largest else self._reserve_step()
        newest = self.model.newest_committed()
        copy_of = self.model.committed[newest].shards if newest is not None else None
        stray = plant(self.location, kind, step, copy_of)
        if stray is None:
            return
        if stray.step is not None:
            self.model.stray_planted(stray.step, stray.what, damaged=stray.damaged)
        self._remember(stray)

    @rule(kind=st.sampled_from(POINTER_KINDS))
    @abort_on_storage_failure
    def plant_a_pointer(self, kind: bytes | str) -> None:
        never = self._reserve_step()
        stray, named = plant_pointer(self.location, kind, never)
        if named is not None:
            self.model.hint_planted(named)
        self._remember(stray)

    def _race(self, operation: OperatorAction, at: int) -> None:
        operator, _ = self.location.open()
        race_a_reader(
            self.location.base, operator, operation, at, self.model, self.location.store_clock
        )
        if operation.took_epoch:
            # A rollback is a takeover from its step (docs/protocol.md §6): what is above it
            # left the history, and the trainer resumes in the operator's epoch, as a
            # restarted run would (the old handle is fenced from now on).
            self.model.epoch_taken(operation.step)
            if operator.lineage().newest != self.model.newest_epoch:
                raise InvariantViolation(
                    "I9",
                    f"a rollback to step {operation.step} left epochs "
                    f"{operator.lineage().newest}, the model {self.model.newest_epoch}",
                )
            self.store = operator

    @precondition(lambda self: bool(self.model.committed))
    @rule(data=st.data(), force=st.booleans(), at=st.integers(0, 24))
    @abort_on_storage_failure
    def operator_deletes_under_a_reader(self, data: Any, force: bool, at: int) -> None:
        step = data.draw(st.sampled_from(sorted(self.model.committed)), label="step")
        self._race(OperatorAction("delete --force" if force else "delete", step=step), at)

    @precondition(lambda self: bool(self.model.committed))
    @rule(data=st.data(), at=st.integers(0, 24))
    @abort_on_storage_failure
    def operator_rolls_back_under_a_reader(self, data: Any, at: int) -> None:
        step = data.draw(st.sampled_from(sorted(self.model.committed)), label="step")
        self._race(OperatorAction("rollback", step=step), at)

    @precondition(lambda self: bool(self.model.committed))
    @rule(keep=st.integers(1, 3), at=st.integers(0, 24))
    @abort_on_storage_failure
    def operator_applies_retention_under_a_reader(self, keep: int, at: int) -> None:
        self._race(OperatorAction("retention", keep=keep), at)

    @invariant()
    def foreign_entries_left_alone(self) -> None:
        if self.fifo_guard.blocked:
            raise InvariantViolation(
                "I4",
                f"a reader blocked opening the FIFO planted at {self.fifo_guard.blocked[0]} "
                f"(it was released by the suite; a resuming trainer would hang forever)",
            )
        for stray in self.planted:
            if not stray.must_stay:
                continue
            changed = disturbed(self.location, stray)
            if changed:
                raise InvariantViolation(
                    "I7",
                    f"{stray.what} was removed or changed: {', '.join(changed[:3])}; "
                    f"ckptstore must leave alone what it did not make",
                )
