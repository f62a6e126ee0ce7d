"""The property-based state machine: its rules in ``state_machine.CheckpointStoreMachine``,
the rules of foreign entries and operators in ``foreign``; ``shrinking`` bounds hypothesis's
shrinking."""

from ckptstore.conformance.machine.state_machine import (
    PROFILES,
    CheckpointStoreMachine,
    make_state_machine,
    run_state_machine,
)

__all__ = ["PROFILES", "CheckpointStoreMachine", "make_state_machine", "run_state_machine"]
