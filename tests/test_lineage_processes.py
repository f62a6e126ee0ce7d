"""Two writer processes on one store: the old run (a zombie) still saving while a restarted
run takes over from an older step (I9, docs/protocol.md §8), on file:// and s3://.

Every interleaving that matters is forced, not hoped for: the zombie holds its step 5 at the
commit point (its superseded-writer check passed) until the test has seen the takeover, then
publishes it (the race the readers' rule covers); the new run holds before saving step 5, the
name the zombie then holds. Each process says what happened on stdout, and waits for a file
the test creates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from child_output import ChildOutput
from conftest import EXTENDED

import ckptstore
from ckptstore.tools.embedded import EmbeddedS3

WORKER = str(Path(__file__).with_name("lineage_worker.py"))
WAIT_S = 120.0
ROUNDS = 10
"""Rounds run under the ``slow`` marker (the default run does the first of each backend)."""


S3_ROUNDS = 3
"""Rounds run on moto in CI (ten seconds each there, one on file://); the other rounds on s3
are extended."""


@pytest.fixture(params=["file", "s3"])
def store_url(request: Any, tmp_path: Path, round_: int) -> Iterator[tuple[str, dict[str, Any]]]:
    if request.param == "file":
        yield f"file://{tmp_path}/store", {}
        return
    if round_ >= S3_ROUNDS and not os.environ.get(EXTENDED):
        pytest.skip(
            f"round {round_} on s3: the same interleaving as rounds 0 to {S3_ROUNDS - 1}; set "
            f"{EXTENDED}=1 to run it; CI leaves it out to stay under 30 minutes"
        )
    server: EmbeddedS3 = request.getfixturevalue("moto_s3")
    prefix = f"lineage/{os.getpid()}-{tmp_path.name}"
    yield server.url(prefix), dict(server.options)


def _start(role: str, url: str, options: dict[str, Any], control: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, WORKER, role, url, json.dumps(options), str(control)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)


def _said(output: ChildOutput, line: str) -> None:
    output.wait_for(lambda said: said == line, WAIT_S, repr(line))


def _reader_sees(url: str, options: dict[str, Any]) -> tuple[list[int], int | None, int | None]:
    reader = ckptstore.open(url, create=False, **options)
    latest = reader.latest()
    if latest is None:
        return reader.steps(), None, None
    return reader.steps(), latest.step, latest.manifest.epoch


@pytest.mark.parametrize(
    "round_", [0, *(pytest.param(n, marks=pytest.mark.slow) for n in range(1, ROUNDS))]
)
def test_a_zombie_and_the_run_that_took_over(
    store_url: tuple[str, dict[str, Any]], tmp_path: Path, round_: int
) -> None:
    url, options = store_url
    control = tmp_path / f"control-{round_}"
    control.mkdir()
    with _start("zombie", url, options, control) as old:
        assert old.stdout is not None
        zombie = ChildOutput(old.stdout)
        _said(zombie, "at commit point 5")  # steps 1-4 published in epoch 0; 5 checked
        assert zombie.lines[:4] == [f"published {step} epoch 0" for step in range(1, 5)]
        assert _reader_sees(url, options) == ([1, 2, 3, 4], 4, 0)

        with _start("new", url, options, control) as new:
            assert new.stdout is not None
            run = ChildOutput(new.stdout)
            _said(run, "took epoch 1")
            _said(run, "published 3 epoch 1")  # step 3 again: the zombie's 3 is old history
            assert _reader_sees(url, options) == ([1, 2, 3], 3, 1)

            (control / "commit-5").touch()  # the zombie publishes past its check
            _said(zombie, "published 5 epoch 0")
            for step in range(6, 9):
                line = zombie.wait_for(
                    lambda said: said.startswith(("superseded", "published")),
                    WAIT_S,
                    f"the zombie's step {step}",
                )
                assert line.startswith(f"superseded {step}: "), line
                assert "superseded by epoch 1" in line, line
                assert "resumed from step 2" in line, line
            _said(zombie, "done")
            assert old.wait(WAIT_S) == 0
            # The zombie's step 5 is published, in epoch 0's name: no reader returns it.
            assert _reader_sees(url, options) == ([1, 2, 3], 3, 1)

            (control / "clash").touch()
            _said(run, "published 5 epoch 1")  # the name the zombie took is the new run's
            _said(run, "published 6 epoch 1")
            _said(run, "done")
            assert new.wait(WAIT_S) == 0

    assert _reader_sees(url, options) == ([1, 2, 3, 5, 6], 6, 1)
    store = ckptstore.open(url, **options)
    expected_writers = {1: "zombie", 2: "zombie", 3: "new", 5: "new", 6: "new"}
    for checkpoint in store.checkpoints():
        assert checkpoint.metadata["writer"] == expected_writers[checkpoint.step]
        assert checkpoint.read("model.bin").startswith(
            f"{expected_writers[checkpoint.step]} {checkpoint.step}".encode()
        )
    assert [(s.step, s.epoch, s.owner) for s in store.superseded()] == [
        (3, 0, 1),
        (4, 0, 1),
        (5, 0, 1),
    ]
    report = store.gc(superseded_grace=0)
    superseded = sorted(item.name for item in report.removed if item.kind == "superseded")
    assert superseded == [f"step {step} of epoch 0 (superseded by epoch 1)" for step in (3, 4, 5)]
    assert store.superseded() == []
    assert _reader_sees(url, options) == ([1, 2, 3, 5, 6], 6, 1)
    assert all(checkpoint.verify().ok for checkpoint in store.checkpoints())
    assert [epoch.parent for epoch in store.lineage().epochs] == [2]
