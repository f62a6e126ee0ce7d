"""The property-based layer: the state machine (``machine``) within the run's time budget, its
failures recorded with hypothesis's shrunk sequence of steps.

The layer gets what the layers before it left of the run's budget (``BUDGET``), fits its
number of examples to that from what a crash case cost, and stops shrinking at its deadline
(``machine.shrinking``).
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from typing import Any

import hypothesis
from hypothesis.errors import DidNotReproduce
from hypothesis.reporting import with_reporter

from ckptstore.conformance.layers.layer import Budget, Findings, SuiteRun
from ckptstore.conformance.machine import PROFILES, make_state_machine, run_state_machine
from ckptstore.conformance.machine.shrinking import shrinking_stops_at
from ckptstore.conformance.model import InvariantViolation
from ckptstore.conformance.outcomes import (
    StorageFailure,
    StorageRefused,
    SuiteError,
    storage_failure,
    suite_failed,
)
from ckptstore.errors import InvalidOptionError
from ckptstore.urls import redact

__all__ = [
    "BUDGET",
    "CALLS_PER_STEP",
    "INVARIANTS",
    "MACHINE_MAX_S",
    "MACHINE_MIN_S",
    "check_reproduction",
    "machine_findings",
    "run_layer",
]

INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I9", "I10")
MACHINE_MAX_S: dict[str, float | None] = {"ci": 25.0, "thorough": None}
"""Seconds the property-based layer takes at most per profile (None: what the budget leaves)."""
MACHINE_MIN_S = 10.0
"""Seconds the property-based layer gets even when the layers before it used the budget (at
most a quarter of the budget)."""
BUDGET = Budget(MACHINE_MAX_S, MACHINE_MIN_S)
MIN_EXAMPLES = {"ci": 25, "thorough": 100}
"""Examples the layer runs whatever the layer's deadline and the machine's load (a deadline
too short for them is exceeded, never met with fewer), unless the storage is slow (a storage
call took longer than ``SLOW_CALL_S``): then it runs what fits (at least
``SLOW_MIN_EXAMPLES``) and the report says so ("cut short by the budget")."""
SLOW_CALL_S = 0.05
"""A storage call that took longer than this, run alone, is a remote server's (or a slow
one's): the embedded emulators answer in a few milliseconds, on a loaded machine too."""
SLOW_MIN_EXAMPLES = 5
"""Examples on slow storage, whatever its budget."""
NETWORKED_CALL_S = 0.001
"""A storage call that took this long or longer, run alone, is a request over a network (an
emulator on 127.0.0.1 included), where examples get ``NETWORKED_STEPS``."""
NETWORKED_STEPS = {"ci": 12}
"""Steps per example where a storage call is a network request, by profile (others, and
other storage: the profile's own, ``machine.PROFILES``): an example's cost is its requests,
and 25 examples of 12 steps fit where 25 of 20 do not. Failures found so far shrink to
fewer steps than this."""
SHRINK_LEAST_S = {"ci": 15.0, "thorough": 120.0}
"""Seconds shrinking gets at least (a quarter of the run's budget at most), from when it
starts, even past the layer's deadline: a failure found late is still shrunk to a short
sequence (then the run ends)."""
CALLS_PER_STEP = 30
"""Storage calls a step of the state machine makes, on average with its checks and its
example's setup and cleanup (measured on moto): to fit examples to the budget."""


def run_layer(run: SuiteRun, found: Findings) -> None:
    """Run the state machine on ``run``'s target, within its layer's deadline if it has one."""
    multipart = run.big_shard_size()
    machine = make_state_machine(run.locations, multipart_size=multipart)
    settings = PROFILES[run.profile]
    deadline = run.layer_deadline
    if run.reproduce:
        version, blob, steps = check_reproduction(run.reproduce)
        if steps is not None:  # found with examples of that many steps: replayed so
            settings = hypothesis.settings(settings, stateful_step_count=steps)
        machine = hypothesis.reproduce_failure(version, blob.encode())(machine)
        run.say("property-based crash injection: replaying one example (--reproduce)")
        note = machine_findings(found, machine, settings, None, run.profile)
        if not found.not_applicable and note != DID_NOT_FAIL:  # one example held: no proof
            found.check(*INVARIANTS)
        found.coverage["property-based"] = f"replayed one example (--reproduce){note}"
        return
    if run.call_s >= NETWORKED_CALL_S and run.profile in NETWORKED_STEPS:
        settings = hypothesis.settings(settings, stateful_step_count=NETWORKED_STEPS[run.profile])
    if deadline is not None:
        settings = _fitted(run, found, settings, deadline - time.monotonic())
    run.say(
        f"property-based crash injection (profile {run.profile}, {settings.max_examples} examples)"
    )
    shrink_least_s = SHRINK_LEAST_S.get(run.profile, 15.0)
    if run.budget_s:  # a quarter of a short budget at most
        shrink_least_s = min(shrink_least_s, run.budget_s / 4)
    note = machine_findings(found, machine, settings, deadline, run.profile, shrink_least_s)
    if not found.not_applicable:  # else the store refused the storage: nothing was checked
        found.check(*INVARIANTS)
        if not machine.sharing["saves"]:
            found.not_applicable.setdefault("I10", NO_SHARING)
    found.coverage["property-based"] = (
        f"{settings.max_examples} examples of up to {settings.stateful_step_count} steps"
        f"{machine_completions(machine, multipart)}{machine_sharing(machine)}{note}"
    )


def _fitted(
    run: SuiteRun, found: Findings, settings: hypothesis.settings, budget: float
) -> hypothesis.settings:
    """``settings`` with as many examples as ``budget`` seconds allow, at least
    ``MIN_EXAMPLES`` (``SLOW_MIN_EXAMPLES`` on slow storage); a number below the profile's is
    recorded as cut short, with why."""
    example_s = run.call_s * CALLS_PER_STEP * settings.stateful_step_count
    affordable = int(budget / max(example_s, 1e-6))
    least = min(MIN_EXAMPLES.get(run.profile, 25), settings.max_examples)
    slow = run.call_s > SLOW_CALL_S
    if slow:
        least = min(SLOW_MIN_EXAMPLES, least)
    examples = max(least, min(settings.max_examples, affordable))
    if examples < settings.max_examples:
        why = (
            f"the storage is slow: a request took {run.call_s * 1000:.0f} ms, an example "
            f"about {example_s:.0f} s"
            if slow
            else f"at least {least} always run"
        )
        found.cut_short["property-based"] = (
            f"{examples} of {settings.max_examples} examples ({why})"
        )
    return hypothesis.settings(settings, max_examples=examples)


DID_NOT_FAIL = "; the example passed this time: it did not fail again"
"""The replay's note when the example held (``--reproduce``): nothing is then held."""


NO_SHARING = (
    "property-based: the store cannot share shards (an incremental save is refused on it), "
    "so no save shared any"
)


def machine_sharing(machine: Any) -> str:
    """How many incremental saves, and sharing saves raced with GC, the machine ran."""
    sharing = getattr(machine, "sharing", None)
    if not sharing:
        return ""
    return f"; incremental saves: {sharing['saves']}, raced with GC: {sharing['races']}"


def machine_completions(machine: Any, multipart: int) -> str:
    """How many of the state machine's crashes fell just before or after a multipart
    completion (stores with multipart only)."""
    crashes = getattr(machine, "completion_crashes", None)
    if not multipart or crashes is None:
        return ""
    return (
        f"; crashes around multipart completions: {crashes['before']} before, "
        f"{crashes['after']} after"
    )


def machine_findings(
    found: Findings,
    machine: Any,
    settings: hypothesis.settings,
    deadline: float | None,
    profile: str = "ci",
    shrink_least_s: float = 0.0,
) -> str:
    """Run the state machine, recording what it found; a note for the coverage line.
    Shrinking stops at ``deadline`` (``time.monotonic()``; None: at hypothesis's own limit).
    ``profile``: the one whose settings these are, named in the command that replays a
    failure (a blob replays only under the step count it was found with: the command names
    it where it is not the profile's). Shrinking gets
    ``shrink_least_s`` at least, from when it starts, whatever ``deadline`` says."""
    undecided = "; stopped by the storage's failure on every run (undecided)"
    printed: list[str] = []
    try:
        with (
            shrinking_stops_at(deadline, least_s=shrink_least_s),
            with_reporter(lambda value: printed.append(str(value))),
        ):
            run_state_machine(machine, settings)
    except DidNotReproduce:
        return DID_NOT_FAIL
    except StorageRefused as refused:  # not applicable here: the probes say what is missing
        for invariant in INVARIANTS:
            found.not_applicable.setdefault(invariant, f"property-based: {refused}")
        return f"; stopped: {refused}"
    except StorageFailure as failure:  # on every run: undecided, neither held nor violated
        found.storage_error(INVARIANTS, f"property-based: {failure}")
        return undecided
    except Exception as exc:
        # Hypothesis raises several distinct failures as one group, each shrunk on its own.
        errors = list(getattr(exc, "exceptions", None) or [exc])  # an ExceptionGroup's, or it
        url = redact(str(getattr(machine.new_location, "base_url", "URL")))
        url += "" if profile == "ci" else f" --profile {profile}"
        count = settings.stateful_step_count
        steps = "" if count == PROFILES[profile].stateful_step_count else f":{count}"
        notes: list[str | None] = []
        failed: list[SuiteError] = []
        for error in errors:  # every violation is recorded before the suite's own failure
            try:
                notes.append(_finding(found, error, printed, url, steps))
            except SuiteError as failure:
                failed.append(failure)
        if failed and not found.violations:
            raise failed[0] from exc
        if any(note is None for note in notes):
            return undecided
        return next((note for note in notes if note), "")
    return ""


def _finding(
    found: Findings, error: BaseException, printed: list[str], url: str, steps: str
) -> str | None:
    """Record one failure the state machine found; its coverage note (None: undecided)."""
    if isinstance(error, InvariantViolation):
        found.violated(error.invariant, _shrunk(error.detail, error, printed, url, steps))
        return _budget_note(error, printed)
    cause = storage_failure(error)  # one that hypothesis shrank: the storage failed
    if cause is None and suite_failed(error):  # the suite's own error: no verdict
        failed = _shrunk(f"a rule failed: {error!r}", error, printed, url, steps)
        raise SuiteError(failed) from error
    if cause is None:  # anything else the store raised is reported, not hidden
        unexpected = _shrunk(f"unexpected error: {error!r}", error, printed, url, steps)
        found.violated("I1", unexpected)
        return _budget_note(error, printed)
    found.storage_error(INVARIANTS, f"property-based: {cause!r}")
    return None


def _budget_note(error: BaseException, printed: list[str]) -> str:
    said = [str(note) for note in getattr(error, "__notes__", [])] + printed
    if not any("stopped because it is making very slow" in line for line in said):
        return ""
    return "; shrinking stopped at the time budget (the sequence shown may not be the shortest)"


_NOT_STEPS = (
    "Falsifying example",
    "Failing test case",
    "You can reproduce",
    "@reproduce_failure",
    "WARNING",
    "PLEASE",
    "stopped because",
    "progress.",
    "take this long",
    "provide a reproducing",
    "performance for",
)


def _steps(error: BaseException, printed: list[str]) -> list[str]:
    """Hypothesis's shrunk sequence of steps: from the exception's notes (where hypothesis
    6.x puts them), else from what it printed through its reporter; without its explanation."""
    notes = [str(note) for note in getattr(error, "__notes__", [])]
    steps = []
    for line in "\n".join(notes or printed).splitlines():
        if line.lstrip().startswith("Explanation:"):
            break
        if line.strip() and not line.lstrip().startswith(_NOT_STEPS):
            steps.append(line.rstrip())
    return steps


def _shrunk(
    message: str, error: BaseException, printed: list[str], url: str, step_count: str = ""
) -> str:
    """``message`` with the shrunk steps and the command that replays them (``step_count``:
    ``:N`` where the examples had N steps, not the profile's number)."""
    steps = _steps(error, printed)
    replay = _replay(error, printed)
    if replay:
        replay += step_count
        message += f"\n  replay it alone: ckptstore conformance {url} --reproduce {replay}"
    if not steps:
        return message
    return message + "\n  shrunk failing sequence:\n" + "\n".join("    " + s for s in steps)


_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([A-Za-z0-9+/=]+)'\)")


def _replay(error: BaseException, printed: list[str]) -> str:
    """``VERSION:BLOB`` of the failing example, from the line hypothesis adds (``print_blob``),
    or "" where it added none."""
    said = [str(note) for note in getattr(error, "__notes__", [])] + printed
    found = _BLOB.search("\n".join(said))
    return f"{found.group(1)}:{found.group(2)}" if found else ""


def check_reproduction(value: str) -> tuple[str, str, int | None]:
    """The hypothesis version, the example blob and the examples' step count (None: the
    profile's) of ``--reproduce VERSION:BLOB[:STEPS]``; raise InvalidOptionError if it is
    malformed or from another hypothesis version (whose blobs this one cannot read)."""
    version, _, rest = value.partition(":")
    blob, _, count = rest.partition(":")
    try:
        base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError):
        blob = ""
    steps = int(count) if count.isdigit() and count.isascii() and 0 < int(count) <= 1000 else None
    if not version or not blob or (count and steps is None):
        raise InvalidOptionError(
            "--reproduce takes VERSION:BLOB[:STEPS], as a report prints it after 'replay it alone'"
        )
    if version != hypothesis.__version__:
        raise InvalidOptionError(
            f"--reproduce {version}:...: the example was found with hypothesis {version}, and "
            f"hypothesis {hypothesis.__version__} is installed; replay it with {version} "
            f"(pip install 'hypothesis=={version}')"
        )
    return version, blob, steps
