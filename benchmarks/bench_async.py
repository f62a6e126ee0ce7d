"""Asynchronous saves: how long training is blocked, and how fast it trains meanwhile.

    python benchmarks/bench_async.py [--size 512M] [--repeats 3]

Blocked time of ``AsyncSaver.save`` against a synchronous ``save_state`` and against the floor
for a copying snapshot: copying the same state once into reused host buffers; and of
``dcp.async_save`` through ``CkptStoreWriter`` (which stages the copy itself, reusing its
buffers, and records the copy's cost as ``snapshot_s``) against ``dcp.async_save`` through
DCP's ``FileSystemWriter`` (DCP's default stager). Then training steps per second while a
background save runs, against none.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.tools.timing import measure, print_table, sizes
from ckptstore.torch import AsyncSaver, save_state
from ckptstore.torch.dcp import CkptStoreWriter

warnings.filterwarnings("ignore", message=".*torch.distributed.*")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512M")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = sizes([args.size])[0]
    state = {f"layer{i}": torch.randn(total // 8 // 4) for i in range(8)}
    size = total // 8 // 4 * 4 * 8
    root = tempfile.mkdtemp(prefix="ckpt-async-")
    store = ckptstore.open(f"{root}/store")
    saver = AsyncSaver(store, max_in_flight=1)
    reused = {name: torch.empty_like(t) for name, t in state.items()}
    step = [0]

    def next_step() -> int:
        step[0] += 1
        return step[0]

    def copy_floor(repeat: int) -> None:
        for name, tensor in state.items():
            reused[name].copy_(tensor)

    def async_blocked(repeat: int) -> None:
        saver.save(next_step(), {"model": state}, rng=False)

    def sync_save(repeat: int) -> None:
        save_state(store, next_step(), {"model": state}, rng=False)

    writer = CkptStoreWriter(ckptstore.open(f"{root}/dcp"))
    in_flight: list[Any] = []
    recorded: list[float] = []

    def dcp_ckptstore(repeat: int) -> None:
        in_flight.append(dcp.async_save(state, storage_writer=writer, checkpoint_id=next_step(),
                                        no_dist=True))  # fmt: skip

    def dcp_filesystem(repeat: int) -> None:
        path = f"{root}/dcp-fs-{next_step()}"
        in_flight.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path),
                                        no_dist=True))  # fmt: skip

    def settle(name: str, repeat: int) -> None:
        saver.wait()
        while in_flight:
            in_flight.pop().result()
        if name == "dcp.async_save, CkptStoreWriter (blocked)":
            latest = writer.store.latest()
            assert latest is not None
            recorded.append(latest.manifest.timings["snapshot_s"])

    results = measure(
        {"copy into reused buffers": copy_floor, "async save (blocked)": async_blocked,
         "sync save": sync_save, "dcp.async_save, CkptStoreWriter (blocked)": dcp_ckptstore,
         "dcp.async_save, FileSystemWriter (blocked)": dcp_filesystem},
        args.repeats,
        after=settle,
    )  # fmt: skip
    print_table(f"Training blocked by a save of {size / 2**30:.2f} GiB", results,
                "copy into reused buffers", size)  # fmt: skip
    sync = results["sync save"].median
    print(
        f"async blocked time = {results['async save (blocked)'].median / sync:.1%} of a sync save\n"
    )
    print(f"snapshot_s recorded by CkptStoreWriter's manifests: "
          f"{', '.join(f'{s * 1000:.1f} ms' for s in recorded)}\n")  # fmt: skip
    writer.close()

    weights = torch.randn(1024, 1024)

    def train(steps: int) -> float:
        started = time.perf_counter()
        x = torch.randn(256, 1024)
        for _ in range(steps):
            x = torch.tanh(x @ weights)
        return steps / (time.perf_counter() - started)

    quiet = train(200)
    saver.save(next_step(), {"model": state}, rng=False)
    busy = train(200)
    saver.wait()
    print(f"training steps/s: {quiet:.0f} without a save, {busy:.0f} during a background save "
          f"({busy / quiet:.2f}x)")  # fmt: skip
    saver.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
