"""The storage is blamed first when the storage is wrong (issue 26, item 3).

Probes measure the behaviours the protocol relies on and no driver declares (listings past
one page, deletes gone at once, sizes as written, one clock for every timestamp GC reads);
a violation one of them explains is reported with the storage's misbehaviour first, naming
the probe ("the storage first: ... see probe '...'"), in text, JSON and JUnit. Each broken
variant here is a model of a real storage bug; the sound backends pass every probe.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import broken_variants as bv
import pytest
from conftest import fsspec_s3_options, fsspec_s3_url
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from ckptstore import registry
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket
from ckptstore.commit.conditional_put import ConditionalPutCommit
from ckptstore.conformance import settling
from ckptstore.conformance.layers.behaviours import (
    CLOCK,
    PAGINATION,
    READ_AFTER_DELETE,
    SIZES,
    STALE_READS,
)
from ckptstore.conformance.layers.crash_points import INVARIANTS, run_crash_points
from ckptstore.conformance.layers.layer import Findings, SuiteRun
from ckptstore.conformance.layers.probes import run_probes
from ckptstore.conformance.layers.races import (
    POINTER,
    Outcome,
    RaceGate,
    RaceResult,
    Round,
    _Judge,
)
from ckptstore.conformance.layers.registry import layer_named
from ckptstore.conformance.location import LocationFactory, open_for_measuring
from ckptstore.conformance.machine import PROFILES, make_state_machine
from ckptstore.conformance.model import InvariantViolation
from ckptstore.conformance.report import BackendReport, render_text, to_json, to_junit
from ckptstore.conformance.reproducible import same_examples
from ckptstore.driver import PutMode, UploadInfo
from ckptstore.hint import encode_hint
from ckptstore.store import Store

PART = 1024
_buckets = itertools.count()


@pytest.fixture
def bucket() -> Iterator[str]:
    name = f"blame-{os.getpid()}-{next(_buckets)}"
    yield name
    drop_bucket(name)


@pytest.fixture
def scheme() -> Iterator[Callable[[str, type[MemoryDriver]], str]]:
    added: list[str] = []

    def add(name: str, driver: type[MemoryDriver]) -> str:
        def open_variant(url: Any, options: Any) -> ConditionalPutCommit:
            return ConditionalPutCommit(
                driver(get_bucket(url.netloc, min_part_size=PART), url.path), part_size=PART
            )

        registry.register(name, open_variant, replace=True)
        added.append(name)
        return name

    yield add
    for name in added:
        registry.unregister(name)


def _report(url: str, *, around: str | None = None, limit: int | None = None) -> BackendReport:
    """The probes and the crash-point layer (crashes ``around`` one call's name, or the first
    ``limit`` calls) on ``url``, recorded as the runner records them."""
    report = BackendReport(url=url, strategy="broken variant")
    location = LocationFactory(url)()
    try:
        report.capabilities = run_probes(location)
    finally:
        location.destroy()
    result = run_crash_points(LocationFactory(url), limit=limit, around=around, workers=2)
    report.checked(*INVARIANTS)
    for failure in result.failures:
        report.violated(failure.invariant, f"{failure.case}: {failure.message}")
    return report


def _row(report: BackendReport, row: str) -> Any:
    return next(probe for probe in report.capabilities if probe.capability == row)


def _first_lines(text: str, invariant: str) -> list[str]:
    """The lines the report prints under a violated ``invariant``."""
    match = re.search(rf"^  {invariant} .*VIOLATED\n((?:      .*\n)+)", text, re.MULTILINE)
    assert match is not None, f"{invariant} not VIOLATED in:\n{text}"
    return [line.strip() for line in match.group(1).splitlines()]


def _blamed_first(report: BackendReport, invariant: str, blamed: str, evidence: str) -> None:
    """``invariant`` is violated with ``evidence``, and the report says ``blamed`` before it,
    in text, JSON and JUnit."""
    lines = _first_lines(render_text([report]), invariant)
    said = [line for line in lines if line.startswith("the storage first: ")]
    assert any(blamed in line for line in said), lines
    assert lines.index(said[-1]) < next(i for i, line in enumerate(lines) if evidence in line)
    found = json.loads(to_json([report]))["backends"][0]["invariants"][invariant]
    assert any(blamed in line for line in found["storage_blamed"])
    assert re.search(
        rf"<failure[^>]*>the storage first: [^<]*{re.escape(blamed)}", to_junit([report])
    )


def test_listings_cut_after_the_first_page_are_blamed_before_gc(bucket: str, scheme: Any) -> None:
    """Issue 26 item 3: a paginated listing cut short read as a GC bug (I7: "GC never
    collected ... 14 days past the grace period")."""
    url = f"{scheme('short-pages', bv.ShortPagesDriver)}://{bucket}/run"
    report = _report(url, around="delete")
    probe = _row(report, PAGINATION)
    assert probe.measured == "violated"
    assert "7 keys listed in pages of 2: whole: only the first 2 of 7 keys" in probe.detail
    _blamed_first(
        report,
        "I7",
        "listings of this storage omit or repeat keys past the first page: see probe "
        "'listings past one page'",
        "GC never collected",
    )


def test_deletes_that_linger_are_blamed_before_gc(bucket: str, scheme: Any) -> None:
    url = f"{scheme('lingering-deletes', bv.LingeringDeletesDriver)}://{bucket}/run"
    report = _report(url, limit=0)  # the workload without a crash
    probe = _row(report, READ_AFTER_DELETE)
    assert probe.measured == "violated"
    assert "deletes linger: right after its delete was answered, the object is still read, " \
        "HEAD, listed" in probe.detail  # fmt: skip
    _blamed_first(report, "I7", "(deletes linger): see probe 'gone after delete'", "GC never")


def test_a_size_misreported_after_multipart_is_blamed_not_the_commit(
    bucket: str, scheme: Any
) -> None:
    url = f"{scheme('zero-size', bv.ZeroSizeMultipartDriver)}://{bucket}/run"
    report = _report(url, limit=0)
    probe = _row(report, SIZES)
    assert probe.measured == "violated"
    assert "an object completed from parts holds 1042 bytes, but HEAD says 0; listing says 0" \
        in probe.detail  # fmt: skip
    multipart = _row(report, "multipart")
    assert "reads back exact, but CompleteMultipartUpload says it holds 0 bytes" in (
        multipart.detail
    )
    _blamed_first(
        report,
        "I1",
        "this storage reports other sizes than it stores: see probe 'sizes as written'",
        "has 0 bytes, manifest says",
    )


def test_listings_stamped_in_another_time_zone_are_a_missing_clock(
    bucket: str, scheme: Any
) -> None:
    url = f"{scheme('local-time', bv.LocalTimeListingDriver)}://{bucket}/run"
    location = LocationFactory(url)()
    try:
        probe = next(r for r in run_probes(location) if r.capability == CLOCK)
    finally:
        location.destroy()
    assert probe.measured == "violated" and probe.required
    assert "the storage's timestamps of one moment differ by 7200 s" in probe.detail
    assert "listing +7200 s" in probe.detail
    report = BackendReport(url=url, strategy="test", capabilities=[probe])
    report.checked("I7")
    assert report.storage_blamed("I7") == []  # only a violation is blamed on anything
    report.violated("I7", "GC removed a live save's data")
    assert report.storage_blamed("I7") == [
        "this storage's timestamps disagree with each other (a time zone, or nodes' clocks): "
        "see probe 'one clock for timestamps'"
    ]


@pytest.mark.parametrize("scheme_name", ["memory", "memory+versioned"])
def test_sound_storage_passes_every_behaviour_probe(
    bucket: str, tmp_path: Any, scheme_name: str
) -> None:
    for url in (f"{scheme_name}://{bucket}/run", f"file://{tmp_path}/{scheme_name}"):
        location = LocationFactory(url)()
        try:
            rows = {r.capability: r for r in run_probes(location)}
        finally:
            location.destroy()
        for row in (READ_AFTER_DELETE, SIZES, CLOCK, *([PAGINATION] if "://b" in url else [])):
            assert rows[row].measured == "held", (url, rows[row])


# -- the page size asked for reaches every server --------------------------------------------


def _server_urls(request: pytest.FixtureRequest, kind: str) -> tuple[str, dict[str, Any]]:
    prefix = f"pages-{os.getpid()}-{next(_buckets)}"
    if kind in ("s3", "fsspec+s3"):
        server = request.getfixturevalue("moto_s3")
        if kind == "s3":
            return f"s3://{server.bucket}/{prefix}", server.options
        return fsspec_s3_url(server, prefix), fsspec_s3_options(server)
    if kind == "gs":
        server = request.getfixturevalue("fake_gcs")
        return server.url(prefix), {}
    server = request.getfixturevalue("azurite")
    return server.url(prefix), server.options


@pytest.mark.parametrize("kind", ["s3", "fsspec+s3", "gs", "az"])
def test_the_page_size_asked_for_makes_a_listing_take_several_pages(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Without it, the pagination probe's 7 keys would come in one page and prove nothing."""
    url, options = _server_urls(request, kind)
    driver = open_for_measuring(url, options).driver
    keys = [f"k{n}" for n in range(7)]
    for key in keys:
        driver.put(key, b"x")
    try:
        asked: list[str] = []
        retried = driver.retried

        def counting(what: str, *args: Any, **kwargs: Any) -> Any:
            asked.append(what)
            return retried(what, *args, **kwargs)

        driver.retried = counting
        driver.list_page_size = 2
        assert [info.key for info in driver.list("k")] == keys
        assert len(asked) == 4, asked  # 2 + 2 + 2 + 1
    finally:
        driver.list_page_size = None
        for key in keys:
            driver.delete(key)


# -- LATEST written without compare-and-swap ---------------------------------------------------


def test_a_latest_put_without_a_condition_is_named_not_blamed_on_if_match(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 item 3: a LATEST written without compare-and-swap read as "two writers'
    If-Match let through" though no If-Match was sent."""
    monkeypatch.setattr(settling, "SETTLE_S", 0.2)  # the judge waits a lagging hint out
    url = f"memory://{bucket}/run"
    location = LocationFactory(url)()
    try:
        gate = RaceGate(location.base.driver, None)
        gate.put("LATEST", b" 5\n")
        gate.put("LATEST", b" 6\n", mode=PutMode.OVERWRITE)
        etag = location.base.driver.head("LATEST").etag
        gate.put("LATEST", b" 7\n", mode=PutMode.update(etag))
        gate.put("other", b"x")
        assert gate.hint_writes == ["plain", "plain", f"if-match {etag.strip(chr(34))}"]
        for step in (5, 6, 7):
            Store(location.base).save(step, {"a.bin": b"a"})
        location.base.driver.put("LATEST", encode_hint(6))  # a lost update
        result = RaceResult()
        judge = _Judge(location, 3, "threads", result)
        swap = (f"if-match {etag.strip(chr(34))}",)
        outcomes = [Outcome(0, "published", hint_writes=swap),
                    Outcome(1, "published", hint_writes=("plain",)),
                    Outcome(2, "published")]  # fmt: skip
        judge._pointer(Round(0, POINTER, 5), outcomes)
        judge.hint = None
        both = [Outcome(0, "published", hint_writes=swap), Outcome(1, "published"),
                Outcome(2, "published", hint_writes=swap)]  # fmt: skip
        judge._pointer(Round(1, POINTER, 5), both)
        judge.hint = None
        gave_up = [Outcome(0, "published", hint_writes=swap), Outcome(1, "published"),
                   Outcome(2, "published")]  # fmt: skip
        judge._pointer(Round(2, POINTER, 5), gave_up)
    finally:
        location.destroy()
    said = [f.message for f in result.failures if f.invariant == "I4"]
    assert any(
        "LATEST was written without compare-and-swap (writer(s) 1 put it plainly, no If-Match sent)"
        in message
        and "went back from 7 to 6" in message
        for message in said
    ), said


# -- leftovers seen by a second route (item 7) ------------------------------------------------


class EmptyUploadListingDriver(MemoryDriver):
    """A server that answers ListMultipartUploads with an empty 200: GC finds no crashed
    upload, and an audit that asked the same way found none either."""

    def list_multipart_uploads(self, prefix: str) -> Iterator[UploadInfo]:
        return iter([])


def test_uploads_a_crash_left_are_found_by_a_route_gc_does_not_take(
    bucket: str, scheme: Any
) -> None:
    url = f"{scheme('empty-upload-listing', EmptyUploadListingDriver)}://{bucket}/run"
    report = _report(url, around="upload_part")
    evidence = "\n".join(report.invariants["I7"].evidence)
    assert "not listed by ListMultipartUploads" in evidence, evidence
    _blamed_first(
        report,
        "I7",
        "this storage does not list incomplete multipart uploads: see probe 'incomplete "
        "uploads listed'",
        "not listed by ListMultipartUploads",
    )
    sound = _report(f"memory://{bucket}/sound", around="upload_part")
    assert sound.invariants["I7"].status == "held"


# -- stale reads: measured, tolerated ------------------------------------------------------------


def test_stale_reads_are_measured_and_tolerated_never_blamed(
    bucket: str, scheme: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: reads that return stale data for a moment were blamed on compare-and-swap
    (MISSING), I4 and I6, though ckptstore (which never overwrites data) is sound on them."""
    monkeypatch.setattr(settling, "SETTLE_S", 1.0)  # two stale reads last milliseconds
    url = f"{scheme('stale-reads', bv.StaleAfterOverwriteDriver)}://{bucket}/run"
    location = LocationFactory(url)()
    try:
        rows = {r.capability: r for r in run_probes(location)}
    finally:
        location.destroy()
    assert rows["compare-and-swap"].measured == rows["conditional-create"].measured == "held"
    stale = rows[STALE_READS]
    assert stale.measured == "violated" and not stale.required
    assert "stale reads measured: an overwritten object read its old bytes 2 time(s)" in (
        stale.detail
    )
    report = BackendReport(url=url, strategy="test", capabilities=list(rows.values()))
    assert report.capability_mismatches == [] and report.outcome == "held"
    assert re.search(r"reads after overwrite +- +no +measured \(tolerated\) / stale reads",
                     render_text([report]))  # fmt: skip
    machine_found = _machine(url, 60)
    assert machine_found is None, machine_found
    found = Findings()
    layer_named("parallel races").run(SuiteRun(LocationFactory(f"{url}2")), found)
    assert found.violations == [] and found.checked


def _machine(url: str, examples: int) -> str | None:
    """What the property-based layer finds in ``examples`` derandomised examples (None:
    nothing)."""
    test = make_state_machine(LocationFactory(url))
    profile = settings(
        PROFILES["ci"], max_examples=examples, stateful_step_count=10, derandomize=True,
        phases=[Phase.explicit, Phase.generate],
    )  # fmt: skip
    try:
        with same_examples():
            run_state_machine_as_test(test, settings=profile)
    except InvariantViolation as exc:
        return str(exc)
    return None
