"""Real crashes on file://: a writer process SIGKILLed in the middle of saves."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
from child_output import ChildOutput

import ckptstore

WRITER = textwrap.dedent(
    """
    import sys, time
    import ckptstore
    url, first = sys.argv[1], int(sys.argv[2])
    store = ckptstore.open(url, retention=ckptstore.KeepLast(3))
    step = first
    while True:
        with store.begin(step, {"step": step}) as pending:
            for rank in range(4):
                with pending.open_shard(f"model/rank{rank:05d}.bin") as shard:
                    for _ in range(8):
                        shard.write(bytes([step % 251]) * 65536)
            print(f"sealing {step}", flush=True)
        print(f"published {step}", flush=True)
        step += 1
    """
)


def _writer(url: str, first: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, url, str(first)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _expected(step: int) -> bytes:
    return bytes([step % 251]) * (8 * 65536)


def _assert_intact(store: ckptstore.Store) -> int:
    latest = store.latest()
    assert latest is not None
    assert latest.metadata == {"step": latest.step}
    for name in latest.names:
        assert latest.read(name) == _expected(latest.step)
    for checkpoint in store.checkpoints():
        assert checkpoint.verify().ok
    return latest.step


def test_sigkill_mid_save_leaves_previous_checkpoint_and_gc_cleans_up(tmp_path):
    url = f"file://{tmp_path}/store"
    store = ckptstore.open(url)
    store.save(0, {f"model/rank{r:05d}.bin": _expected(0) for r in range(4)}, {"step": 0})
    slow = textwrap.dedent(
        """
        import sys, time, ckptstore
        store = ckptstore.open(sys.argv[1])
        with store.begin(1) as pending, pending.open_shard("model/rank00000.bin") as shard:
            shard.write(b"x" * 100000)
            print("writing", flush=True)
            time.sleep(60)
        """
    )
    with subprocess.Popen([sys.executable, "-c", slow, url], stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert store.latest().step == 0
    assert store.steps() == [0]
    leftovers = [n for n in os.listdir(tmp_path / "store") if ".pending-" in n]
    assert len(leftovers) == 1
    assert store.gc().removed == []  # younger than the default grace period: may be alive
    assert store.gc(grace=timedelta(minutes=5)).kept_young[0].name == leftovers[0]
    later = ckptstore.open(url, clock=lambda: time.time() + 3600 + 60)
    report = later.gc()
    assert [item.name for item in report.removed] == leftovers
    assert [n for n in os.listdir(tmp_path / "store") if not n.startswith("step-")] == ["LATEST"]
    assert _assert_intact(store) == 0
    store.save(1, {"model/rank00000.bin": _expected(1)})  # the step can be saved again


@pytest.mark.parametrize("seed", range(6))
def test_random_sigkills_never_expose_a_partial_checkpoint(tmp_path, seed):
    rng = random.Random(seed)
    url = f"file://{tmp_path}/store"
    store = ckptstore.open(url)
    next_step = 0
    published_max = -1
    for _ in range(3):
        with _writer(url, next_step) as proc:
            assert proc.stdout is not None
            output = ChildOutput(proc.stdout)
            try:
                # A commit between kills, whatever the machine's speed: each round has a
                # checkpoint to keep (and the first, one to find at all).
                output.wait_for(
                    lambda line: line.startswith("published "), 120, "a new checkpoint published"
                )
                time.sleep(rng.uniform(0.0, 0.3))  # where the kill lands; nothing depends on it
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(60)
            lines = output.drain(60)
        published = [int(line.split()[1]) for line in lines if line.startswith("published ")]
        latest = _assert_intact(store)
        assert latest >= max(published)  # committed means visible after the crash
        assert latest >= published_max  # I4: never goes back
        published_max = latest
        next_step = latest + 1
    later = ckptstore.open(url, clock=lambda: time.time() + 7200)
    later.gc()
    names = os.listdir(tmp_path / "store")
    assert all(n.startswith("step-") or n == "LATEST" for n in names), names
    _assert_intact(store)
