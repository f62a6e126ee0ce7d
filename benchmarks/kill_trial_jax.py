"""The kill trial, ckptstore.jax beside Orbax: a writer SIGKILLed at a random point of a save
over an existing checkpoint; what does a restart find?

    python benchmarks/kill_trial_jax.py [--trials 40] [--size 256M]

Each trial starts a writer process (8 simulated CPU devices) that saves step 1 of a sharded
pytree, says "saving 2", and saves step 2 over it; the trial SIGKILLs it at a time drawn
uniformly from [0, 1.2 x] the time such a save takes (measured first, per library), so that
kills land all through the save and some after it. Then it restarts as a trainer would, in
this process: ckptstore ``load_pytree(store.latest())``; Orbax
``CheckpointManager(directory).restore(latest_step())``, and checks every value. Outcomes:
the new step, the old step, or nothing loadable (the latest is missing, fails to load, or
holds wrong values). Local directories only.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.jax import load_pytree, save_pytree
from ckptstore.tools.timing import sizes

LIBRARIES = ("ckptstore", "orbax")


def _tree(step: int, size: int) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    rows = max(8, size // 4 // 4 // 1024 // 8 * 8)
    return {
        f"w{i}": jax.device_put(
            np.full((rows, 1024), step * 10 + i, np.float32), NamedSharding(mesh, P("d"))
        )
        for i in range(4)
    }


def _abstract(size: int) -> dict[str, Any]:
    return {
        name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        for name, leaf in _tree(0, size).items()
    }


def writer(library: str, directory: str, size: int) -> None:
    """Save step 1, then step 2 (the one a trial kills), saying when each begins and ends."""
    if library == "ckptstore":
        store = ckptstore.open(directory)
        save = lambda step: save_pytree(store, step, _tree(step, size))  # noqa: E731
    else:
        manager = ocp.CheckpointManager(directory)

        def save(step: int) -> None:
            manager.save(step, args=ocp.args.StandardSave(_tree(step, size)))
            manager.wait_until_finished()

    save(1)
    print("saving 2", flush=True)
    save(2)
    print("saved 2", flush=True)


def restart(library: str, directory: str, size: int) -> str:
    """What a restarting trainer finds: "new", "old" or "nothing loadable"."""
    try:
        if library == "ckptstore":
            latest = ckptstore.open(directory).latest()
            if latest is None:
                return "nothing loadable"
            step, tree = latest.step, load_pytree(latest, _abstract(size))
        else:
            manager = ocp.CheckpointManager(directory)
            found = manager.latest_step()
            if found is None:
                return "nothing loadable"
            step = int(found)
            tree = manager.restore(step, args=ocp.args.StandardRestore(_abstract(size)))
    except Exception:  # a restart that fails to load is a restart with nothing
        return "nothing loadable"
    for i, name in enumerate(sorted(tree)):
        if not np.all(np.asarray(tree[name]) == step * 10 + i):
            return "nothing loadable"
    return {1: "old", 2: "new"}.get(step, "nothing loadable")


def _run_writer(library: str, directory: str, size: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--writer", library, "--directory", directory, "--size", size],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _until(process: subprocess.Popen[str], line: str) -> float:
    assert process.stdout is not None
    for text in process.stdout:
        if text.strip() == line:
            return time.perf_counter()
    raise RuntimeError(f"the writer ended before it said {line!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--size", default="256M")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--writer", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = sizes([args.size])[0]
    if args.writer:
        writer(args.writer, args.directory, size)
        return
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="kill-trial-jax-")
    save_time = {}
    for library in LIBRARIES:  # how long a save of step 2 takes, to spread the kills over it
        directory = f"{root}/{library}-calibration"
        with _run_writer(library, directory, args.size) as process:
            begun = _until(process, "saving 2")
            save_time[library] = _until(process, "saved 2") - begun
            process.wait(120)
        shutil.rmtree(directory)
    outcomes: dict[str, Counter[str]] = {library: Counter() for library in LIBRARIES}
    for trial in range(args.trials):
        for library in LIBRARIES:
            directory = f"{root}/{library}-{trial}"
            with _run_writer(library, directory, args.size) as process:
                _until(process, "saving 2")
                time.sleep(rng.uniform(0, 1.2 * save_time[library]))
                process.send_signal(signal.SIGKILL)
                process.wait(60)
            outcomes[library][restart(library, directory, size)] += 1
            shutil.rmtree(directory, ignore_errors=True)
    print(f"### Kill trial: {args.trials} writers SIGKILLed while saving step 2 of "
          f"{size / 2**20:.0f} MiB over step 1 (8 devices, a local directory)\n")  # fmt: skip
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}\n")
    print("| library | a save takes | nothing loadable | old step | new step |")
    print("| --- | --- | --- | --- | --- |")
    for library in LIBRARIES:
        found = outcomes[library]
        print(f"| {library} | {save_time[library] * 1000:.0f} ms | {found['nothing loadable']} | "
              f"{found['old']} | {found['new']} |")  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
