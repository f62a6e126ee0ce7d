"""Multi-rank saves under torchrun (gloo, CPU): one commit for every rank's shards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import ckptstore
from ckptstore.tools.embedded import EmbeddedS3

WORKER = Path(__file__).parent / "dist_save_worker.py"
JOB_WAIT_S = 240.0
"""Longer than the workers' 60 s gloo timeout plus torch's start-up on a busy machine."""


def _launch(
    worker: Path, ranks: int, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``worker`` under torchrun with ``ranks`` CPU processes (gloo).

    A job that does not end within ``JOB_WAIT_S`` fails the test: this bound, not a timed
    assertion, is what checks that a rank's death fails the job instead of hanging it.
    """
    try:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={ranks}", str(worker), *args],
            capture_output=True, text=True, timeout=JOB_WAIT_S, check=False,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun {' '.join(args)} did not end within {JOB_WAIT_S:.0f} s: {exc}")


def _torchrun(
    url: str, step: int, ranks: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return _launch(WORKER, ranks, "--store", url, "--step", str(step), *extra, env=env)


def _target(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The store's URL, its options here, and the environment its worker processes need."""
    if kind == "file":
        return f"file://{tmp_path}/store", {}, {}
    server: EmbeddedS3 = request.getfixturevalue("moto_s3")
    url = server.url(f"dist-{os.getpid()}-{tmp_path.name}")
    return url, server.options, server.credentials_env()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_rank_shard_in_one_commit(
    kind: str, ranks: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, options, env = _target(kind, tmp_path, request)
    result = _torchrun(url, 3, ranks, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = ckptstore.open(url, **options).latest()
    assert checkpoint is not None
    assert checkpoint.step == 3
    assert checkpoint.names == [f"model/rank{r:05d}.bin" for r in range(ranks)]
    assert checkpoint.manifest.writer.world_size == ranks
    assert checkpoint.verify().ok


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_rank_killed_mid_save_publishes_nothing(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, options, env = _target(kind, tmp_path, request)
    assert _torchrun(url, 1, 2, env=env).returncode == 0  # published: a commit before the kill
    result = _torchrun(url, 2, 2, "--die-rank", "1", env=env)  # fails, within JOB_WAIT_S
    assert result.returncode != 0
    store = ckptstore.open(url, **options)
    assert store.steps() == [1]
    assert store.latest().verify().ok
    later = ckptstore.open(url, clock=lambda: time.time() + 7200, **options)
    later.gc()
    assert later.gc(grace=0).removed == []
    assert store.latest().step == 1


DCP_WORKER = Path(__file__).parent / "dist_dcp_worker.py"


def _dcp(
    url: str, mode: str, step: int, ranks: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    args = ("--store", url, "--mode", mode, "--step", str(step), *extra)
    return _launch(DCP_WORKER, ranks, *args, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_dcp_save_and_load_across_world_sizes(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, options, env = _target(kind, tmp_path, request)
    jobs = [("save", 1, 2, ()), ("load", 1, 4, ("--then-save", "2")), ("load", 2, 2, ())]
    for mode, step, ranks, then in jobs:  # a 4-rank job resumes from 2 ranks, then saves
        result = _dcp(url, mode, step, ranks, *then, env=env)
        assert result.returncode == 0, f"{mode} {step} x{ranks}: {result.stderr[-3000:]}"
    store = ckptstore.open(url, **options)
    assert store.steps() == [1, 2]
    assert store.get(1).manifest.writer.world_size == 2
    assert store.get(2).manifest.writer.world_size == 4
    assert "dcp-metadata.json" in store.get(2).names


@pytest.mark.slow
def test_dcp_rank_killed_mid_save_publishes_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    assert _dcp(url, "save", 1, 2).returncode == 0  # published: a commit before the kill
    assert _dcp(url, "save", 2, 2, "--die-rank", "1").returncode != 0  # within JOB_WAIT_S
    store = ckptstore.open(url)
    assert store.steps() == [1]
    assert _dcp(url, "load", 1, 2).returncode == 0  # the previous checkpoint is intact
