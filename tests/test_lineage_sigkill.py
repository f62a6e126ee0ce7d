"""A run SIGKILLed in the middle of its takeover, after the epoch record is staged and before
the commit point (the rename on a file system, the conditional put on an object store): the
store has no epoch, or the whole epoch; readers answer as before; GC collects the staging
once it is older than the grace period; the next takeover takes the epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from child_output import ChildOutput

import ckptstore
from ckptstore.fencing import INTENT_STALE_S
from ckptstore.tools.embedded import EmbeddedS3

WAIT_S = 120.0

TAKER = textwrap.dedent(
    """
    import json, sys, ckptstore
    store = ckptstore.open(sys.argv[1], **json.loads(sys.argv[2]))
    driver = store.strategy.driver
    name = "rename_noreplace" if hasattr(driver, "rename_noreplace") else "put"
    real = getattr(driver, name)

    def held(*args, **kwargs):
        if "epoch-" in str(args[0]):
            print("at the commit point of the epoch", flush=True)
            sys.stdin.readline()  # held until killed
        return real(*args, **kwargs)

    setattr(driver, name, held)
    store.take_over(1)
    print("took the store over", flush=True)
    """
)


@pytest.fixture(params=["file", "s3"])
def store_url(request: Any, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return f"file://{tmp_path}/store", {}
    server: EmbeddedS3 = request.getfixturevalue("moto_s3")
    return server.url(f"lineage-kill/{os.getpid()}-{tmp_path.name}"), dict(server.options)


def test_sigkill_in_the_middle_of_a_takeover(
    store_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, options = store_url
    store = ckptstore.open(url, **options)
    store.save(1, {"m": b"one"})
    store.save(2, {"m": b"two"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-c", TAKER, url, json.dumps(options)]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    ) as taker:
        assert taker.stdout is not None
        said = ChildOutput(taker.stdout)
        said.wait_for(lambda line: line.startswith("at the commit point"), WAIT_S, "its hold")
        if url.startswith("file://"):
            staged = list((tmp_path / "store" / "epochs").glob("epoch-*.pending-*"))
            assert len(staged) == 1 and (staged[0] / "record.json").is_file()
        taker.send_signal(signal.SIGKILL)
        assert taker.wait(WAIT_S) == -signal.SIGKILL

    reader = ckptstore.open(url, create=False, **options)
    assert reader.lineage().newest == 0  # killed before its commit point: no epoch at all
    latest = reader.latest()
    assert latest is not None and (latest.step, latest.manifest.epoch) == (2, 0)
    assert reader.steps() == [1, 2]
    young = reader.gc()  # the default grace: a taker that may be stalled keeps its staging
    assert not [item for item in young.removed if item.kind == "epoch-staging"]
    old = reader.gc(grace=timedelta(0))
    collected = [item.name for item in old.removed if item.kind == "epoch-staging"]
    if url.startswith("file://"):
        assert len(collected) == 1 and ".pending-" in collected[0]
    # The dead taker's hold on step 1 (a takeover from below the newest holds its parent
    # against deleters, docs/protocol.md §8.5) outlives any grace shorter than INTENT_STALE_S:
    # a taker stalled that long may still be alive. A GC that late removes it.
    later = ckptstore.open(url, create=False, **options)
    later.clock = lambda: time.time() + INTENT_STALE_S + 5
    marks = [item.name for item in later.gc(grace=timedelta(0)).removed if item.kind == "marker"]
    assert len(marks) == 1 and "hold-step-00000000000000000001" in marks[0]
    if url.startswith("file://"):
        assert not [p.name for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]
    assert reader.steps() == [1, 2]

    epoch = reader.take_over(1)  # the next run takes the epoch the dead one did not
    assert epoch.number == 1
    reader.save(2, {"m": b"two again"})
    latest = ckptstore.open(url, create=False, **options).latest()
    assert latest is not None and (latest.step, latest.manifest.epoch) == (2, 1)
    assert latest.read("m") == b"two again"
