"""The conformance suite's trust layer (issue 29): every forgery of a writer without the key is
refused on a correct store, and a reader that skips a check is caught, with the attack named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptstore.checkpoint import _DigestCheck
from ckptstore.conformance.layers import trust
from ckptstore.conformance.layers.layer import Findings, SuiteRun, TargetKind
from ckptstore.conformance.layers.registry import layer_named
from ckptstore.conformance.location import LocationFactory
from ckptstore.lineage import Epoch
from ckptstore.manifest import Manifest
from ckptstore.tools.embedded_gcs import EmbeddedGCS


def _run(url: str) -> Findings:
    kind = TargetKind.FILE_SYSTEM if url.startswith("file:") else TargetKind.OBJECT_STORE
    found = Findings()
    trust.run_layer(SuiteRun(LocationFactory(url), "ci", kind), found)
    return found


@pytest.fixture(params=["file", "memory", "memory+versioned"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/trust"
    return f"{request.param}://trust-{id(request)}/run"


def test_every_forgery_is_refused_on_a_correct_store(url: str) -> None:
    found = _run(url)
    assert found.violations == [] and found.undecided == []
    assert found.checked == ("I6",)
    assert "7 forgeries" in found.coverage["trust"]
    assert layer_named("trust").invariants == ("I6",)


def test_a_reader_that_does_not_check_signatures_is_caught(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Manifest, "check_trust", lambda self, trust, *, where: "any")
    monkeypatch.setattr(Epoch, "check_trust", lambda self, trust, *, where: "any")
    found = _run(url)
    evidence = "\n".join(text for invariant, text in found.violations if invariant == "I6")
    for attack in (
        "shard replaced, its CRC32Cs, digests and checksum recomputed",
        "manifest metadata edited",
        "signature stripped",
    ):
        assert f"trust: {attack}" in evidence
        assert "a reader that trusts only the writer's key read every shard of it" in evidence
    assert "a takeover unsigned" in evidence


def test_a_reader_that_does_not_check_digests_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_DigestCheck, "early_problem", lambda self: None)
    monkeypatch.setattr(_DigestCheck, "final_problem", lambda self, record: None)
    found = _run("memory://trust-digests/run")
    (violation, *_) = found.violations
    assert violation[0] == "I6" and "trust: shard bytes replaced (step 2)" in violation[1]


def test_a_forgery_the_storage_rules_out_is_named_and_not_judged(fake_gcs: EmbeddedGCS) -> None:
    """fake-gcs keeps versions it cannot delete: a shard's pinned bytes can be neither changed
    nor removed there, so the "bytes replaced" forgery cannot be made. It was judged anyway,
    and the intact checkpoint read fine: I6 VIOLATED on a correct store (gs+versioned://)."""
    versioned = fake_gcs.versioned_bucket(f"{fake_gcs.bucket}-trust-versioned")
    url = versioned.url(f"trust-{os.getpid()}", scheme="gs+versioned", part_size=4096)
    found = Findings()
    run = SuiteRun(LocationFactory(url, versioned.options), "ci", TargetKind.OBJECT_STORE)
    trust.run_layer(run, found)
    assert found.violations == [] and found.undecided == []
    assert found.checked == ("I6",)
    coverage = found.coverage["trust"]
    assert coverage.startswith("6 forgeries") and coverage.endswith(
        "; not possible here: shard bytes replaced (a pinned version can be neither changed "
        "nor deleted)"
    )
    assert "it: shard replaced, its CRC32Cs" in coverage  # the one not made is not listed
