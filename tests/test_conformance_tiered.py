"""The conformance suite on tiered pairs: crash points inside replication hold every
invariant on file:// + memory:// (and file:// + s3:// on moto, an extended run), and a
replicator that forgets what an earlier process left owed is caught (I2); the pair keeps one
history with a partitioned fast tier, and a replicator that copies a fast-tier branch the
durable lineage does not hold is caught (I9)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
from broken_variants import HistoryBlindReplicator
from conftest import extended_conformance
from hypothesis import Phase, settings

from ckptstore.conformance.layers.tiers import (
    TieredPairFactory,
    run_partitioned,
    run_tiered_crash_points,
)
from ckptstore.conformance.location import LocationFactory
from ckptstore.conformance.runner import run_tiered
from ckptstore.tiers.replication import ReplicateAll, ReplicationPolicy
from ckptstore.tools.embedded import EmbeddedS3


def _memory(name: str) -> str:
    return f"memory://{name}-{os.getpid()}/tiers?min_part_size=4096&part_size=4096"


def test_replication_crash_points_hold_on_file_and_memory(tmp_path: Path) -> None:
    report = run_tiered(f"file://{tmp_path}", _memory("tiered-suite"))
    assert report.ok, report.invariants
    coverage = report.coverage["replication crash points"]
    crashes = int(coverage.split(": ")[1].split(" crashes")[0])
    assert crashes > 50, coverage
    assert report.invariants["I9"].status == "held", report.invariants["I9"]
    assert "partitioned fast tier" in report.coverage


def _pair(tmp_path: Path, name: str, **options: object) -> TieredPairFactory:
    return TieredPairFactory(
        LocationFactory(f"file://{tmp_path}"), LocationFactory(_memory(name)), **options
    )


def test_the_pair_keeps_one_history_with_a_partitioned_fast_tier(tmp_path: Path) -> None:
    result = run_partitioned(_pair(tmp_path, "tiered-partitioned"))
    assert (result.cases, result.failures, result.storage_errors) == (1, [], [])
    assert result.invariants_checked == {"I9"}


def test_a_replicator_copying_a_branch_the_durable_lineage_does_not_hold_is_caught(
    tmp_path: Path,
) -> None:
    factory = _pair(tmp_path, "tiered-history-blind", replicator=HistoryBlindReplicator)
    result = run_partitioned(factory)
    assert [failure.invariant for failure in result.failures] == ["I9"], result.failures
    assert "copied from the partitioned node's fast tier" in result.failures[0].message


class ForgetfulPolicy(ReplicationPolicy):
    """Copies only what was published after it started: a replicator whose queue lives in
    memory, so that what a dead process left owed is never copied."""

    def __init__(self) -> None:
        self.before: set[int] | None = None

    def select(self, fast_steps: Sequence[int], durable_newest: int | None) -> list[int]:
        if self.before is None:
            self.before = set(fast_steps)
        return ReplicateAll().select([s for s in fast_steps if s not in self.before], None)


def test_a_replicator_that_forgets_what_was_owed_is_caught(tmp_path: Path) -> None:
    factory = TieredPairFactory(
        LocationFactory(f"file://{tmp_path}"),
        LocationFactory(_memory("tiered-forgetful")),
        policy=ForgetfulPolicy,
    )
    result = run_tiered_crash_points(factory, workers=2, limit=4)
    assert {failure.invariant for failure in result.failures} == {"I2"}, result.failures
    # Lost from the fast tier (its retention keeps only what the policy says is owed) or
    # never copied: either way a published checkpoint that never becomes durable.
    assert all("crash" in failure.case for failure in result.failures)


@extended_conformance
def test_replication_crash_points_hold_on_file_and_s3(tmp_path: Path, moto_s3: EmbeddedS3) -> None:
    durable = moto_s3.url(f"tiered-suite/{os.getpid()}", part_size=moto_s3.min_part_size)
    report = run_tiered(f"file://{tmp_path}", durable, durable_options=moto_s3.options)
    assert report.ok, report.invariants


def test_the_state_machine_composes_tiers_with_takeovers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26 item 9: tiers x takeovers was a fixed case of the tiered mode only; the
    state machine now draws a partitioned fast tier among its other rules on every backend.
    A replicator blind to the durable history is caught there when the job restarts on the
    partitioned node (its zombie replicator is refused by the durable epoch fence), with the
    rule in the shrunk steps; a sound replicator passes the same rule, every way it is drawn."""
    from ckptstore.conformance.layers.layer import Findings
    from ckptstore.conformance.layers.property_based import machine_findings
    from ckptstore.conformance.machine import PROFILES, make_state_machine, state_machine
    from ckptstore.conformance.reproducible import same_examples

    for before, during, taken, heal in itertools.product(
        (0, 2), (1, 2), (False, True), state_machine.HEALS
    ):
        sound = make_state_machine(LocationFactory(f"memory://tiers-sound-{os.getpid()}/run"))()
        try:
            sound.save_shards([100], None, 0)
            sound.invariants_hold()
            sound.fast_tier_partitioned(before, during, taken, heal)
            sound.invariants_hold()
            sound.save_shards([100], None, 0)
            sound.invariants_hold()
        finally:
            sound.teardown()
    monkeypatch.setattr(state_machine, "Replicator", HistoryBlindReplicator)
    found = Findings()
    machine = make_state_machine(LocationFactory(f"memory://tiers-blind-{os.getpid()}/run"))
    derandomized = settings(
        PROFILES["ci"], max_examples=200, derandomize=True, phases=[Phase.generate, Phase.shrink]
    )
    with same_examples():
        machine_findings(found, machine, derandomized, None)
    assert found.violations, "the history-blind replicator was not caught"
    invariant, evidence = found.violations[0]
    assert invariant == "I9", evidence
    assert "fast_tier_partitioned" in evidence and "the job restarts on the node" in evidence


def test_what_a_tiered_run_could_not_remove_is_in_its_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tiered run's locations are its pair's: what the durable tier's cleanup could not
    remove was never reported (only the fast URL's factory was asked)."""
    from ckptstore.conformance.location import Location
    from ckptstore.conformance.report import render_text

    destroy = Location.destroy

    def refusing(self: Location) -> None:
        destroy(self)
        if "/durable" in self.url and not self.cleanup_problems:
            self.cleanup_problems.append("objects under durable: the storage refused (test)")

    monkeypatch.setattr(Location, "destroy", refusing)
    report = run_tiered(
        f"memory://tiered-cleanup-{os.getpid()}/fast",
        f"memory://tiered-cleanup-{os.getpid()}/durable",
    )
    text = render_text([report])
    assert "objects under durable: the storage refused (test)" in report.coverage["cleanup"], text
