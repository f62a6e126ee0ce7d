"""Storage that misbehaves one way at a time, and the library not fooled by it (issue 24:
"Storage that misbehaves", and item 18's reset UploadPart).

Each case runs against moto behind the S3 proxy (tests/s3_proxy.py) made to misbehave: a
gateway whose If-None-Match checks, then writes; listings that lag or end early; a bit
flipped in one GET; every try of one part reset. The lagging listing also runs on file://
through a driver that hides an entry, and the one-observation verdict on memory://.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar

import pytest
from s3_proxy import (
    Action,
    CheckThenWrite,
    Forward,
    LaggingListings,
    Request,
    Reset,
    Rewrite,
    S3Proxy,
    cut_listing,
    drop_listed_keys,
    flip_a_bit,
)

import ckptstore
from ckptstore.backends.memory import MemoryDriver, drop_bucket, get_bucket
from ckptstore.backends.posix import PosixDriver
from ckptstore.commit import conditional_put
from ckptstore.commit.conditional_put import PROBE_PREFIX, ConditionalPutCommit
from ckptstore.commit.rename import RenameCommit
from ckptstore.driver import PutMode
from ckptstore.errors import CapabilityError, CheckpointExistsError
from ckptstore.store import Store
from ckptstore.tools.embedded import EmbeddedS3

KiB = 1024
HOUR = 3600.0
_ids = itertools.count()


@pytest.fixture(autouse=True)
def fresh_conditional_create_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test probes afresh: a proxy's port may be one an earlier test's proxy had."""
    monkeypatch.setattr(
        conditional_put, "_CONDITIONAL_CREATE", conditional_put._ConditionalCreateChecks()
    )


def _prefix(name: str) -> str:
    return f"misbehaving-{name}-{os.getpid()}-{next(_ids)}"


def _open(server: EmbeddedS3, prefix: str, **options: Any) -> Store:
    url = server.url(prefix, part_size=64 * KiB, **options)
    return ckptstore.open(url, **server.options)


def _blob(size: int, seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(size))


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and text in r.getMessage()]  # fmt: skip


def _conditional_create_under(part: str) -> Callable[[Request], bool]:
    def when(request: Request) -> bool:
        return (
            request.operation == "PutObject"
            and request.header("If-None-Match") == "*"
            and f"/{part}/" in request.path
        )

    return when


def _race_first(pairs_of: Callable[[Request], bool]) -> Callable[[Request], Action]:
    """The first two requests ``pairs_of`` selects go through a gateway that checks, then
    writes: both pass the check before either writes, and both writes land before either
    answer (the later write's bytes stay); every other request is forwarded."""
    checked, written = threading.Barrier(2, timeout=30), threading.Barrier(2, timeout=30)
    left = [2]
    lock = threading.Lock()
    race = CheckThenWrite(between=lambda: checked.wait(), after=lambda: written.wait())

    def rule(request: Request) -> Action:
        with lock:
            if left[0] and pairs_of(request):
                left[0] -= 1
                return race
        return Forward()

    return rule


def _in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at once; each one's result, or the exception it raised."""
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as exc:  # reported to the test
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


# -- a non-atomic If-None-Match: a gateway that checks, then writes ------------------------


def test_racing_writers_through_a_non_atomic_create_are_not_both_told_they_won(
    moto_s3: EmbeddedS3, caplog: pytest.LogCaptureFixture
) -> None:
    with S3Proxy(moto_s3, _race_first(_conditional_create_under("manifests"))) as proxy:
        server = proxy.through(moto_s3)
        prefix = _prefix("racing-writers")
        writers = [_open(server, prefix) for _ in range(2)]
        data = [_blob(1000, 1), _blob(1000, 2)]
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            results = _in_threads(
                *(
                    lambda w=w, d=d: w.save(5, {"model.bin": d})
                    for w, d in zip(writers, data, strict=True)
                )
            )
        won = [i for i, result in enumerate(results) if not isinstance(result, Exception)]
        lost = [i for i, result in enumerate(results) if isinstance(result, CheckpointExistsError)]
        assert (len(won), len(lost)) == (1, 1), results
        latest = _open(server, prefix).latest()
        assert latest is not None
        assert latest.read("model.bin") == data[won[0]]  # the winner's bytes are what is there
        assert latest.manifest.attempt == results[won[0]].manifest.attempt
        assert "not atomic" in str(results[lost[0]])
        assert len(_warnings(caplog, "conditional create is not atomic")) == 1


def test_racing_takers_through_a_non_atomic_create_get_different_epochs(
    moto_s3: EmbeddedS3, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = _prefix("racing-takers")
    _open(moto_s3, prefix).save(1, {"model.bin": _blob(100, 1)})
    with S3Proxy(moto_s3, _race_first(_conditional_create_under("epochs"))) as proxy:
        server = proxy.through(moto_s3)
        takers = [_open(server, prefix) for _ in range(2)]
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            epochs = _in_threads(*(lambda t=t: t.take_over(1).number for t in takers))
        assert sorted(epochs) == [1, 2], epochs  # one lost epoch 1, and took the next
        assert [t.epoch for t in takers] == epochs
        assert _open(server, prefix).lineage().newest == 2
        assert len(_warnings(caplog, "conditional create is not atomic")) == 1


# -- a listing that lags ----------------------------------------------------------------------


def test_latest_is_the_hinted_step_that_a_lagging_listing_does_not_show(
    moto_s3: EmbeddedS3, caplog: pytest.LogCaptureFixture
) -> None:
    lag = LaggingListings()
    with S3Proxy(moto_s3, lag.rule) as proxy:
        server = proxy.through(moto_s3)
        prefix = _prefix("lagging")
        writer = _open(server, prefix)
        for step in range(1, 12):
            writer.save(step, {"model.bin": _blob(100, step)})
        lag.lagging = True  # from now on, listings do not show what is written
        writer.save(12, {"model.bin": _blob(100, 12)})
        reader = _open(server, prefix)
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            for _ in range(2):
                latest = reader.latest()
                assert latest is not None
                assert latest.step == 12
                assert latest.read("model.bin") == _blob(100, 12)
            assert reader.steps() == list(range(1, 13))
        assert len(_warnings(caplog, "lagging listing")) == 1  # reported once
        lag.catch_up()
        assert reader.latest().step == 12


class HidingPosixDriver(PosixDriver):
    """A file system whose directory listings of the root lag: ``hidden`` names are left
    out, though they can be opened and stat'ed (an NFS client's stale directory cache)."""

    hidden: ClassVar[set[str]] = set()

    def listdir(self, path: str) -> list[str]:
        names = super().listdir(path)
        return [n for n in names if path not in ("", ".") or n not in self.hidden]


def test_latest_on_file_is_the_hinted_step_that_a_lagging_listing_does_not_show(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    driver = HidingPosixDriver(str(tmp_path / "store"))
    strategy = RenameCommit(driver)
    strategy.open_root(create=True)
    store = Store(strategy)
    for step in (1, 2, 3):
        store.save(step, {"model.bin": _blob(100, step)})
    driver.hidden = {"step-00000000000000000003"}
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        latest = store.latest()
        assert latest is not None
        assert latest.step == 3
        assert store.steps() == [1, 2, 3]
    assert len(_warnings(caplog, "lagging listing")) == 1


# -- a listing cut short ----------------------------------------------------------------------


def _manifests_listing(request: Request) -> bool:
    return request.operation == "ListObjectsV2" and "manifests/" in request.query.get("prefix", "")


def test_a_listing_cut_short_hides_no_published_step_before_or_after_gc(
    moto_s3: EmbeddedS3,
) -> None:
    rule: list[Callable[[Request], Action]] = [lambda r: Forward()]
    with S3Proxy(moto_s3, lambda r: rule[0](r)) as proxy:
        server = proxy.through(moto_s3)
        prefix = _prefix("cut-short")
        writer = _open(server, prefix)
        for step in range(1, 13):
            writer.save(step, {"model.bin": _blob(100, step)})
        dead = writer.begin(13)
        dead.write("model.bin", _blob(100, 13))
        del dead  # its writer died: garbage for GC
        # Pages of at most 9 entries, each presented as the last one.
        rule[0] = lambda r: Rewrite(cut_listing(9)) if r.operation == "ListObjectsV2" else Forward()
        reader = _open(server, prefix)
        assert reader.steps() == list(range(1, 13))
        assert reader.latest().step == 12
        # Every listing (GC's too) leaves out the manifests of 10-12, and says it is complete:
        # their attempts' data looks unreferenced to anyone who trusts the listing.
        hide = drop_listed_keys(lambda key: "manifests/step-000000000000000000" in key
                                and int(key.rsplit("-", 1)[1][:20]) >= 10)  # fmt: skip
        rule[0] = lambda r: Rewrite(hide) if r.operation == "ListObjectsV2" else Forward()
        later = _open(server, prefix)
        later.clock = lambda: time.time() + 2 * HOUR
        report = later.gc(grace=timedelta(hours=1))
        assert [item.kind for item in report.removed] == ["attempt"]  # only the dead one
        assert "13" in report.removed[0].name
        assert any("did not show step 12" in warning for warning in report.warnings)
        assert 12 in later.steps()
        rule[0] = lambda r: Forward()
        healed = _open(server, prefix)
        assert healed.steps() == list(range(1, 13))
        for step in range(1, 13):
            assert healed.get(step).verify().ok


# -- a bit flipped in transit on a GET ----------------------------------------------------------


def test_a_bit_flipped_in_the_probes_read_back_is_read_again(moto_s3: EmbeddedS3) -> None:
    flipped: list[Request] = []
    lock = threading.Lock()

    def rule(request: Request) -> Action:
        probe = PROBE_PREFIX in request.path and "clock-" not in request.path
        with lock:
            if probe and request.operation == "GetObject" and not flipped:
                flipped.append(request)
                return Rewrite(flip_a_bit)
        return Forward()

    with S3Proxy(moto_s3, rule) as proxy:
        server = proxy.through(moto_s3)
        store = _open(server, _prefix("flipped"))
        store.save(1, {"model.bin": b"weights"})
        store.save(2, {"model.bin": b"weights"})
        assert len(flipped) == 1  # the probe's read-back after its 412 was damaged once
        assert store.steps() == [1, 2]


class IgnoresIfNoneMatchOnce(MemoryDriver):
    """A server that lets one second create of a probe key through (a glitch), then never."""

    glitches: ClassVar[list[int]] = [1]

    def put(self, key: str, data: Any, **kwargs: Any) -> Any:
        create = kwargs.get("mode") == PutMode.CREATE and key.startswith(PROBE_PREFIX)
        if create and self.glitches[0] and any(True for _ in self.list(key)):
            self.glitches[0] -= 1
            kwargs["mode"] = PutMode.OVERWRITE
        return super().put(key, data, **kwargs)


@pytest.fixture
def bucket_name() -> Iterator[str]:
    name = f"misbehaving-{os.getpid()}-{next(_ids)}"
    yield name
    drop_bucket(name)


def test_a_probe_verdict_from_one_observation_is_not_remembered(bucket_name: str) -> None:
    get_bucket(bucket_name)
    IgnoresIfNoneMatchOnce.glitches = [1]
    strategy = ConditionalPutCommit(IgnoresIfNoneMatchOnce(get_bucket(bucket_name), "run"))
    strategy.open_root(create=True)
    store = Store(strategy)
    with pytest.raises(CapabilityError, match="second probe saw the condition honoured"):
        store.save(1, {"model.bin": b"weights"})
    assert store.save(1, {"model.bin": b"weights"}).step == 1  # probed again, and honoured
    assert store.save(2, {"model.bin": b"weights"}).step == 2


# -- item 18: a reset UploadPart ----------------------------------------------------------------


def test_a_part_whose_every_try_is_reset_is_uploaded_again(moto_s3: EmbeddedS3) -> None:
    resets: list[Request] = []
    lock = threading.Lock()

    def rule(request: Request) -> Action:
        with lock:
            part = request.operation == "UploadPart" and request.query.get("partNumber") == "2"
            if part and len(resets) < 2:  # every one of the driver's tries (max_attempts=2)
                resets.append(request)
                return Reset()
        return Forward()

    with S3Proxy(moto_s3, rule) as proxy:
        server = proxy.through(moto_s3)
        store = _open(server, _prefix("parts"), max_attempts=2)
        data = _blob(150 * KiB, 3)  # three parts of 64 KiB
        store.save(1, {"model.bin": data})
        assert len(resets) == 2
        assert store.latest().read("model.bin") == data


class FlipsOneManifestRead(MemoryDriver):
    """A network that flips a bit in the first GET of each manifest (the writer's read-back)."""

    flipped: ClassVar[list[str]] = []

    def get(self, key: str, *, version_id: str | None = None) -> tuple[bytes, Any]:
        data, info = super().get(key, version_id=version_id)
        if key.startswith("manifests/") and key not in self.flipped:
            self.flipped.append(key)
            return flip_a_bit(data), info
        return data, info


def test_a_bit_flipped_in_a_publishs_read_back_is_read_again(bucket_name: str) -> None:
    get_bucket(bucket_name)
    FlipsOneManifestRead.flipped = []
    strategy = ConditionalPutCommit(FlipsOneManifestRead(get_bucket(bucket_name), "run"))
    strategy.open_root(create=True)
    store = Store(strategy)
    assert store.save(1, {"model.bin": b"weights"}).step == 1  # not taken for another's
    assert FlipsOneManifestRead.flipped == ["manifests/step-00000000000000000001.json"]
    assert store.latest().read("model.bin") == b"weights"


class HidesManifests(MemoryDriver):
    """A listing that leaves out the manifests of ``hidden`` steps (reads still find them)."""

    hidden: ClassVar[set[int]] = set()

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[Any]:
        hidden = [f"step-{step:020d}" for step in self.hidden]
        listed = super().list(prefix, start_after=start_after)
        return iter([info for info in listed if not any(h in info.key for h in hidden)])


def test_a_listing_is_cross_checked_with_the_newest_epochs_parent(bucket_name: str) -> None:
    """No LATEST hint to go by: the step the newest takeover resumed from was published, so a
    listing that does not show it is incomplete."""
    get_bucket(bucket_name)
    HidesManifests.hidden = set()

    def open_store() -> Store:
        strategy = ConditionalPutCommit(HidesManifests(get_bucket(bucket_name), "run"))
        strategy.open_root(create=True)
        return Store(strategy)

    writer = open_store()
    for step in (1, 2, 3):
        writer.save(step, {"model.bin": _blob(100, step)})
    writer.take_over(3)
    writer.strategy.reset_latest_hint(None)
    HidesManifests.hidden = {3}
    reader = open_store()
    assert reader.steps() == [1, 2, 3]
    assert reader.latest().step == 3
