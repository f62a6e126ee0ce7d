"""The property-based state machine: rules in ``state_machine``, and the rules of foreign
entries and operators in ``foreign``; ``shrinking`` bounds hypothesis's shrinking."""

from ckptstore.conformance.machine.state_machine import (
    PROFILES,
    make_state_machine,
    run_state_machine,
)

__all__ = ["PROFILES", "make_state_machine", "run_state_machine"]
