"""A writer killed with SIGKILL in the middle of a save, on the backends whose own test files
have no such test: the previous checkpoint stays the newest and whole, nothing of the killed
save is visible, and GC (once the attempt is older than the grace period) leaves nothing it
can find. (s3:// in test_s3.py, gs:// in test_gcs.py, az:// in test_azure.py, fsspec+s3:// in
test_fsspec.py, file:// in test_crash_posix.py.)"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from typing import Any

import pytest
from conftest import BackendUnderTest

import ckptstore
from ckptstore.driver import Capability

PREVIOUS = b"previous" * 1000

WRITER = textwrap.dedent(
    """
    import json, sys, time, ckptstore
    store = ckptstore.open(sys.argv[1], **json.loads(sys.argv[2]))
    with store.begin(2) as pending, pending.open_shard("model/rank0.bin") as shard:
        for index in range(100000):
            shard.write(bytes([index % 251]) * (64 * 1024))
            if index == 8:  # several parts' worth written: the save is under way
                print("writing", flush=True)
            time.sleep(0.01)
    """
)


def _options(backend: BackendUnderTest) -> dict[str, Any]:
    """The keyword arguments that open ``backend``'s store (credentials, endpoint)."""
    own = getattr(backend, "options", None)
    if isinstance(own, dict):
        return own
    return dict(backend.server.options)  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["gs+versioned", "fsspec+gcs", "fsspec+abfs"], indirect=True)
def test_sigkill_mid_save_leaves_the_previous_checkpoint_and_nothing_gc_can_find(
    backend: BackendUnderTest,
) -> None:
    store = backend.open()
    store.save(1, {"model/rank0.bin": PREVIOUS})
    driver = store.strategy.driver
    options = _options(backend)
    command = [sys.executable, "-c", WRITER, backend.url, json.dumps(options)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as writer:
        assert writer.stdout is not None
        ready, _, _ = select.select([writer.stdout], [], [], 120)
        assert ready, "the writer said nothing in 120 s"
        line = writer.stdout.readline()  # the save is under way (or the writer died: "")
        assert line == "writing\n", f"the writer ended before its save was under way: {line!r}"
        if Capability.MULTIPART in driver.capabilities:
            deadline = time.monotonic() + 60
            while not list(driver.list_multipart_uploads("")):  # parts on the server
                assert writer.poll() is None, "the writer ended before its upload was under way"
                assert time.monotonic() < deadline, "no upload under way after 60 s"
                time.sleep(0.05)
        writer.kill()
        writer.wait()
    latest = store.latest()
    assert latest is not None and latest.step == 1
    assert latest.read("model/rank0.bin") == PREVIOUS
    assert store.steps() == [1]  # nothing of the killed save is visible
    later = ckptstore.open(backend.url, clock=lambda: time.time() + 7200, **options)
    later.gc(grace=timedelta(hours=1))
    if Capability.MULTIPART in driver.capabilities:
        assert list(driver.list_multipart_uploads("")) == []  # the killed upload was freed
    assert [
        name
        for name in backend.raw_names()
        if "step-00000000000000000002" in name and "manifests/" not in name
    ] == []  # nothing of attempt 2 that GC could find is left
    assert store.latest().read("model/rank0.bin") == PREVIOUS  # type: ignore[union-attr]
