"""Multi-rank saves under torchrun (gloo, CPU): one commit for every rank's shards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import extended

pytest.importorskip("torch")

import ckptstore
from ckptstore.tools.embedded import EmbeddedS3

WORKER = Path(__file__).parent / "dist_save_worker.py"
CHECKOUT = Path(__file__).resolve().parent.parent
"""The workers import ckptstore from this checkout, whatever is installed."""
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
            env={**os.environ, "PYTHONPATH": _python_path(), "GLOO_SOCKET_IFNAME": "lo",
                 **(env or {})},
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun {' '.join(args)} did not end within {JOB_WAIT_S:.0f} s: {exc}")


def _python_path() -> str:
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(CHECKOUT), *([inherited] if inherited else [])])


def _failure(result: subprocess.CompletedProcess[str]) -> str:
    """What the ranks said (their tracebacks), then the end of torchrun's own report."""
    ranks = [line for line in result.stderr.splitlines() if line.startswith("[rank")]
    return "\n".join(ranks[-60:]) + "\n...\n" + result.stderr[-1500:]


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


def _check_published(url: str, options: dict[str, Any], step: int, ranks: int) -> None:
    checkpoint = ckptstore.open(url, **options).latest()
    assert checkpoint is not None
    assert checkpoint.step == step
    assert checkpoint.names == [f"model/rank{r:05d}.bin" for r in range(ranks)]
    assert checkpoint.manifest.writer.world_size == ranks
    assert checkpoint.verify().ok


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_every_rank_shard_in_one_commit(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, options, env = _target(kind, tmp_path, request)
    result = _torchrun(url, 3, 4, env=env)
    assert result.returncode == 0, _failure(result)
    _check_published(url, options, 3, 4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_rank_killed_mid_save_publishes_nothing(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, options, env = _target(kind, tmp_path, request)
    first = _torchrun(url, 1, 2, env=env)  # published: a commit before the kill
    assert first.returncode == 0, _failure(first)
    _check_published(url, options, 1, 2)
    killed = _torchrun(url, 2, 2, "--die-rank", "1", env=env)  # fails, within JOB_WAIT_S
    assert killed.returncode != 0, _failure(killed)
    store = ckptstore.open(url, **options)
    assert store.steps() == [1]
    assert store.latest().verify().ok
    later = ckptstore.open(url, clock=lambda: time.time() + 7200, **options)
    later.gc()
    assert later.gc(grace=0).removed == []
    assert store.latest().step == 1


LOAD_WORKER = Path(__file__).parent / "dist_load_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_rank_loads_the_step_the_coordinator_chose(ranks: int, tmp_path: Path) -> None:
    """A step published between the ranks' arrivals: DCP and load_state load one step."""
    result = _launch(LOAD_WORKER, ranks, "--store", f"file://{tmp_path}/stores")
    assert result.returncode == 0, _failure(result)
    for api in ("dcp", "state"):  # the injected publish happened
        assert ckptstore.open(f"file://{tmp_path}/stores/{api}").steps() == [1, 2]


DCP_WORKER = Path(__file__).parent / "dist_dcp_worker.py"


def _dcp(
    url: str, mode: str, step: int, ranks: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    args = ("--store", url, "--mode", mode, "--step", str(step), *extra)
    return _launch(DCP_WORKER, ranks, *args, env=env)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "file",
        pytest.param(
            "s3",
            marks=extended(
                "DCP's resharding is the adapter's, whatever the store; every rank's shards "
                "in one commit on s3:// is test_every_rank_shard_in_one_commit[s3]"
            ),
        ),
    ],
)
def test_dcp_save_and_load_across_world_sizes(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, options, env = _target(kind, tmp_path, request)
    jobs = [("save", 1, 2, ()), ("load", 1, 4, ("--then-save", "2")), ("load", 2, 2, ())]
    for mode, step, ranks, then in jobs:  # a 4-rank job resumes from 2 ranks, then saves
        result = _dcp(url, mode, step, ranks, *then, env=env)
        assert result.returncode == 0, f"{mode} {step} x{ranks}: {_failure(result)}"
    store = ckptstore.open(url, **options)
    assert store.steps() == [1, 2]
    assert store.get(1).manifest.writer.world_size == 2
    assert store.get(2).manifest.writer.world_size == 4
    assert "dcp-metadata.json" in store.get(2).names


@pytest.mark.slow
def test_dcp_rank_killed_mid_save_publishes_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    first = _dcp(url, "save", 1, 2)  # published: a commit before the kill
    assert first.returncode == 0, _failure(first)
    killed = _dcp(url, "save", 2, 2, "--die-rank", "1")  # fails, within JOB_WAIT_S
    assert killed.returncode != 0, _failure(killed)
    store = ckptstore.open(url)
    assert store.steps() == [1]
    load = _dcp(url, "load", 1, 2)  # the previous checkpoint is intact
    assert load.returncode == 0, _failure(load)


@pytest.mark.slow
def test_the_ranks_take_a_tiered_pair_over_once_and_publish_in_its_epochs(
    tmp_path: Path,
) -> None:
    """``agreement.take_over`` on a tiered URL: rank 0 takes both tiers over, every other
    rank joins the pair's two epochs (``TieredStore.join_epochs``), and each rank's save is
    published in them, in both tiers."""
    url = ckptstore.tiered_url(f"file://{tmp_path}/fast", f"file://{tmp_path}/durable")
    with ckptstore.open(url) as pair:
        pair.save(1, {"rank0.bin": b"\0" * 10})
    result = _launch(Path(__file__).parent / "dist_takeover_worker.py", 2, "--store", url)
    assert result.returncode == 0, _failure(result)
    said = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert said == ["rank 0 epoch 1 fast 1 durable 1", "rank 1 epoch 1 fast 1 durable 1"], said
    for tier in ("fast", "durable"):
        store = ckptstore.open(f"file://{tmp_path}/{tier}", create=False)
        assert store.lineage().newest == 1
        assert [store.manifest(step).epoch for step in (10, 11)] == [1, 1]
