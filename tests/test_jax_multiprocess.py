"""Two JAX processes (``jax.distributed``, 4 CPU devices each) publish one checkpoint through
the coordinator protocol, and load the step the coordinator chose onto another mesh; a process
that dies before its shards are sealed means nothing is published."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jax")

import ckptstore
from ckptstore.tools.embedded import free_port

WORKER = Path(__file__).parent / "jax_process_worker.py"


def _run_job(
    url: str, mode: str, env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), port, url, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    done = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=180)
            done.append(
                subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
            )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(30)
    return done


def _result(done: subprocess.CompletedProcess[str]) -> Any:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture
def url(request: pytest.FixtureRequest) -> tuple[str, dict[str, str] | None]:
    """An S3 store (moto): each process's load reads its boxes with ranged GETs (the
    single-process tests cover file://, and the dying process below a directory)."""
    server = request.getfixturevalue("moto_s3")
    import os

    query = "&".join(f"{k}={v}" for k, v in server.options.items() if not k.startswith("aws_"))
    return (
        f"s3://{server.bucket}/jax?{query}",
        {**os.environ, **server.credentials_env()},
    )


@pytest.mark.slow
def test_two_processes_publish_one_checkpoint_and_load_it_resharded(url: Any) -> None:
    location, env = url
    first, second = (_result(done) for done in _run_job(location, "save", env))
    assert first["devices"] == second["devices"] == 8
    assert first["saved"] == second["saved"] == 1
    assert first["loaded"] == second["loaded"] == [1, "two processes"]
    assert first["shards"] == [
        "pytree-index.p00000.json",
        "pytree-index.p00001.json",
        "pytree.json",
        "pytree.p00000.00000.safetensors",
        "pytree.p00001.00000.safetensors",
    ]
    checkpoint = ckptstore.open(location, **({} if env is None else _credentials(env))).get(1)
    assert checkpoint.manifest.writer.world_size == 2
    assert checkpoint.metadata["by"] == "coordinator"


def _credentials(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
    }


@pytest.mark.slow
def test_a_process_that_dies_before_sealing_publishes_nothing(tmp_path: Path) -> None:
    location = str(tmp_path / "store")
    first, second = _run_job(location, "die")
    assert second.returncode == 17  # it died inside its write
    coordinator = _result(first)
    assert "published" not in coordinator
    assert "not saved" in coordinator["error"]
    assert coordinator["steps"] == []
    store = ckptstore.open(location)
    assert store.steps() == []
    report = store.gc()  # what the dead attempt staged is found and removed
    assert store.steps() == []
    assert report is not None


@pytest.mark.slow
def test_a_process_that_fails_its_snapshot_fails_the_save_on_all_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    """Process 1's tree holds a leaf that cannot be stored: it raises InvalidInputError, the
    coordinator hears of it at once (no timeout), nothing is published, and the processes
    still agree on which save is which: the next two saves publish."""
    location = str(tmp_path / "store")
    first, second = (_result(done) for done in _run_job(location, "one-fails"))
    assert first["first"] == "CkptStoreError"
    assert second["first"] == "InvalidInputError"
    assert first["steps"] == second["steps"] == [2, 3]
    # a process saving another tree, or another step: nothing published, every process told
    assert first["renamed"] == "CkptStoreError"
    assert second["renamed"] == "CkptStoreError<-CoordinationError"
    assert first["other step"] == "CkptStoreError"
    assert second["other step"] == "CkptStoreError<-CoordinationError"
    # an asynchronous save failed; the next is refused on both, the one after publishes
    assert first["in background"] == "CkptStoreError"
    assert first["after it"].startswith("CkptStoreError")
    assert second["after it"].startswith("CkptStoreError")
    assert first["steps after"] == second["steps after"] == [2, 3, 7]
    assert ckptstore.open(location).get(7).step == 7
