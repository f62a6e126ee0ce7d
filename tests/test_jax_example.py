"""The Flax + Optax example (examples/jax_train_resume.py), SIGKILLed inside its saves and in
its training steps, resumes to exactly the state of a run that was never interrupted."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_output import ChildOutput

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

import ckptstore

EXAMPLE = Path(__file__).parent.parent / "examples" / "jax_train_resume.py"
RUN_WAIT_S = 240.0
"""How long one run may take to reach what the test waits for (it imports JAX and compiles, on
a machine that may be busy): a bound against hanging, not a timing assertion."""


def _run(store: Path, result: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-u", str(EXAMPLE), "--store", str(store), "--steps", "30",
         "--save-every", "3", "--async", "--result", str(result)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip


def _finish(process: subprocess.Popen[str]) -> str:
    try:
        output, _ = process.communicate(timeout=RUN_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the example did not finish within {RUN_WAIT_S:.0f} s")
    assert process.returncode == 0, output
    return output


def _step_of(line: str, event: str) -> int:
    word, _, number = line.partition(" ")
    return int(number) if word == event and number.isdigit() else -1


def _kill_after_a_commit(
    store: Path, result: Path, mid_save: bool, rng: random.Random, committed: int
) -> int:
    """Run until a step after ``committed`` is published, then SIGKILL inside the next save
    (between its snapshot and its publish) or in the training steps; the newest step said
    saved."""
    with _run(store, result) as process:  # the pipe closed on the way out
        assert process.stdout is not None
        output = ChildOutput(process.stdout)
        try:
            line = output.wait_for(
                lambda text: _step_of(text, "saved") > committed, RUN_WAIT_S, "a new published step"
            )
            saved = _step_of(line, "saved")
            if mid_save:
                output.wait_for(
                    lambda text: _step_of(text, "snapshot") > saved, RUN_WAIT_S, "a snapshot"
                )
            deadline = time.monotonic() + rng.uniform(0, 0.02)
            while time.monotonic() < deadline and output.next_line(deadline - time.monotonic()):
                pass
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(60)
        lines = output.drain(60)
    return max(_step_of(text, "saved") for text in lines)


@pytest.mark.slow
def test_the_sigkilled_jax_example_resumes_bitwise_exact(tmp_path: Path) -> None:
    reference = tmp_path / "reference.json"
    with _run(tmp_path / "uninterrupted", reference) as process:
        _finish(process)
    rng = random.Random(2026)
    store, result, committed = tmp_path / "interrupted", tmp_path / "resumed.json", 0
    for mid_save in (True, False):  # a kill between snapshot and publish, one in the steps
        said = _kill_after_a_commit(store, result, mid_save, rng, committed)
        latest = ckptstore.open(str(store)).latest()
        assert latest is not None, f"step {said} was published, then nothing survived the kill"
        assert latest.step >= said  # what was published survives the kill
        committed = latest.step
    with _run(store, result) as process:
        output = _finish(process)
    assert f"resumed from step {committed}" in output
    expected, got = json.loads(reference.read_text()), json.loads(result.read_text())
    assert got == expected  # parameters, Adam moments, PRNG key, loss log, counters
