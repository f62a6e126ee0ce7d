"""The multi-process commit (``ckptstore.coordinated``) refuses processes that disagree: a
process saving another step than the coordinator's, or another structure, means nothing is
published on any commit family (its shards went into no checkpoint, and the step can still be
saved). The processes here are threads exchanging values through queues; the framework
transports (torch.distributed, JAX) are tested in their own files."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore.coordinated import COORDINATOR, save_coordinated
from ckptstore.errors import CkptStoreError, CoordinationError
from ckptstore.pending import PendingCheckpoint


class _Job:
    """The queues between the threads of one job."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.to_rank = [queue.Queue[Any]() for _ in range(size)]
        self.to_coordinator = queue.Queue[tuple[int, Any]]()


class ThreadCollective:
    """A ``Collective`` of threads (every call collective, as the protocol asks)."""

    def __init__(self, job: _Job, rank: int) -> None:
        self.job, self.rank, self.size = job, rank, job.size

    def broadcast(self, value: Any) -> Any:
        if self.rank == COORDINATOR:
            for rank in range(1, self.size):
                self.job.to_rank[rank].put(value)
            return value
        return self.job.to_rank[self.rank].get(timeout=60)

    def gather(self, value: Any) -> list[Any] | None:
        if self.rank != COORDINATOR:
            self.job.to_coordinator.put((self.rank, value))
            return None
        values = [value] + [None] * (self.size - 1)
        for _ in range(self.size - 1):
            rank, other = self.job.to_coordinator.get(timeout=60)
            values[rank] = other
        return values


def _run(url: str, steps: list[int], agreements: list[str | None]) -> list[Any]:
    """Each thread saves its step with its agreement; each one's checkpoint step or error."""
    job = _Job(len(steps))
    outcomes: list[Any] = [None] * len(steps)

    def process(rank: int) -> None:
        def write(pending: PendingCheckpoint) -> None:
            pending.write(f"rank{rank}.bin", f"rank {rank} of step {steps[rank]}".encode())

        try:
            checkpoint = save_coordinated(
                ckptstore.open(url),
                steps[rank],
                write,
                ThreadCollective(job, rank),
                agreement=agreements[rank],
            )
            outcomes[rank] = checkpoint.step
        except Exception as exc:  # the test names it (a thread's exception is otherwise lost)
            outcomes[rank] = exc

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(len(steps))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return outcomes


FAMILIES = ["file", "memory", "memory+versioned"]
"""Rename, conditional put and version pin: each family records a joined shard differently."""


@pytest.fixture(params=FAMILIES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    return f"{request.param}://{tmp_path.name}-{request.param.replace('+', '-')}/store"


def test_agreeing_processes_publish_one_checkpoint(url: str) -> None:
    assert _run(url, [3, 3], ["tree-a", "tree-a"]) == [3, 3]
    checkpoint = ckptstore.open(url).get(3)
    assert checkpoint.read("rank1.bin") == b"rank 1 of step 3"
    assert checkpoint.verify().ok


def test_a_process_saving_another_step_publishes_nothing(url: str) -> None:
    """Rank 1 saves step 4 into the coordinator's step 5: its shards would be step 4's data
    under step 5 (version pin), or a manifest no reader accepts (conditional put)."""
    coordinator, other = _run(url, [5, 4], [None, None])
    assert isinstance(coordinator, CkptStoreError) and "out of step" in str(coordinator)
    assert isinstance(other.__cause__, CoordinationError)
    store = ckptstore.open(url)
    assert store.steps() == [] and store.latest() is None
    assert _run(url, [5, 5], [None, None]) == [5, 5]  # the step can still be saved
    assert ckptstore.open(url).get(5).read("rank1.bin") == b"rank 1 of step 5"


def test_a_process_saving_another_structure_publishes_nothing(url: str) -> None:
    coordinator, other = _run(url, [2, 2], ["tree-a", "tree-b"])
    assert isinstance(coordinator, CkptStoreError) and "another structure" in str(coordinator)
    assert isinstance(other.__cause__, CoordinationError)
    assert ckptstore.open(url).steps() == []
    assert _run(url, [2, 2], ["tree-b", "tree-b"]) == [2, 2]
