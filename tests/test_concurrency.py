"""Eight writers, readers, a GC and an operator on one store at once (issue 11, acceptance).

Writers save (pairs of them the same steps) with KeepLast(2); a GC runs throughout; an
operator deletes old checkpoints and rolls back twice; readers call latest() and read every
shard all the while. No reader may ever get None while a checkpoint exists, an integrity
error, a partial or wrong checkpoint, or a step older than one it saw (except across a
rollback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from concurrency_worker import SHARDS, shard_bytes

import ckptstore
from ckptstore.tools.embedded import EmbeddedS3

WORKER = str(Path(__file__).with_name("concurrency_worker.py"))
WRITERS = 8
READERS = 2


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_reader(saw: list[dict[str, Any]], rollbacks: list[dict[str, Any]]) -> list[str]:
    """Steps a reader saw never go back, except across a rollback that overlapped."""
    problems = []
    high: dict[str, Any] | None = None
    for event in saw:
        if high is not None and event["step"] < high["step"]:
            explained = any(
                rollback["began"] <= event["t"] and rollback["t"] >= high["began"]
                for rollback in rollbacks
            )
            if not explained:
                problems.append(f"saw step {event['step']} after step {high['step']}")
        high = event  # the newest observation of the highest step so far, or after a rollback
    return problems


def _run(url: str, tmp_path: Path, env: dict[str, str], seconds: float) -> None:
    store = ckptstore.open(url, **_options(env))
    store.save(0, {name: shard_bytes(0, name) for name in SHARDS})
    go = tmp_path / "go"
    roles = [("writer", i) for i in range(WRITERS)]
    roles += [("reader", i) for i in range(READERS)] + [("gc", 0), ("operator", 0)]
    processes = []
    for role, index in roles:
        log = tmp_path / f"{role}-{index}.jsonl"
        command = [sys.executable, WORKER, role, "--store", url, "--index", str(index)]
        command += ["--go", str(go), "--log", str(log)]
        processes.append(((role, index, log), subprocess.Popen(command, env=env)))
    _wait_until_ready([log for (_, _, log), _ in processes], [p for _, p in processes])
    tmp = tmp_path / "go.tmp"
    tmp.write_text(f"{time.monotonic() + seconds}\n")
    tmp.rename(go)
    codes = {
        (role, index): process.wait(timeout=seconds + 240)
        for (role, index, _), process in processes
    }
    logs = {(role, index): _events(log) for (role, index, log), _ in processes}
    rollbacks = [e for e in logs[("operator", 0)] if e["kind"] == "rollback"]
    violations = [e["what"] for events in logs.values() for e in events if e["kind"] == "violation"]
    assert not violations, violations[:10]
    for (role, index), events in logs.items():
        assert codes[(role, index)] == 0, f"{role} {index} exited with {codes[(role, index)]}"
        assert events and events[-1]["kind"] == "done", f"{role} {index} did not finish"
    published = [e for (r, _), ev in logs.items() if r == "writer" for e in ev]
    published = [e for e in published if e["kind"] == "published"]
    for index in range(READERS):
        saw = [e for e in logs[("reader", index)] if e["kind"] == "saw"]
        assert len(saw) >= 5, f"reader {index} made only {len(saw)} reads"
        assert not _check_reader(saw, rollbacks)
    assert len(published) >= WRITERS, f"only {len(published)} checkpoints published"
    assert store.latest(verified=True) is not None, "the store was left without a checkpoint"
    assert not store.strays()


def _wait_until_ready(logs: list[Path], processes: list[subprocess.Popen[bytes]]) -> None:
    """Every process has opened the store (imports on 2 busy cores take seconds)."""
    give_up = time.monotonic() + 240
    while time.monotonic() < give_up:
        if all(any(e["kind"] == "ready" for e in _events(log)) for log in logs):
            return
        exited = [p.args for p in processes if p.poll() is not None]
        assert not exited, f"a worker exited before it was ready: {exited[0]}"
        time.sleep(0.1)
    raise AssertionError("the workers were not ready within 240 s")


def _options(env: dict[str, str]) -> dict[str, Any]:
    if "AWS_ACCESS_KEY_ID" not in env:
        return {}
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
    }


@pytest.mark.slow
def test_concurrent_writers_readers_gc_and_operator_on_posix(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    (tmp_path / "logs").mkdir()
    _run(url, tmp_path / "logs", dict(os.environ), seconds=12)


@pytest.mark.slow
def test_concurrent_writers_readers_gc_and_operator_on_s3(
    tmp_path: Path, moto_s3: EmbeddedS3
) -> None:
    url = moto_s3.url(f"runs/concurrency-{os.getpid()}")
    env = dict(os.environ)
    env.update(AWS_ACCESS_KEY_ID=moto_s3.access_key, AWS_SECRET_ACCESS_KEY=moto_s3.secret_key)
    _run(url, tmp_path, env, seconds=15)
