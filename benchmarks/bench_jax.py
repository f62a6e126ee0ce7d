"""ckptstore.jax against Orbax on the same pytree and mesh: save, restore, restore onto another
mesh, and the time an asynchronous save blocks the trainer.

    python benchmarks/bench_jax.py [--size 1G] [--repeats 3]

The state is ``--size`` of float32 in 8 arrays, each sharded over 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), into a local directory. Orbax 0.12
is ``StandardCheckpointer`` (sync) and ``AsyncCheckpointer(StandardCheckpointHandler())``;
ckptstore is ``save_pytree``/``load_pytree``/``AsyncPytreeSaver`` on a file:// store (every
save fsynced before it is published; Orbax's save is measured as it returns, and followed by
an fsync of its files, durable as ckptstore's). Dirty pages are written back before each
save (no contender pays for another's). Contenders run interleaved, each repeat a new step and
directory (removed once measured); the restore onto 4 devices reports ckptstore's bytes read
against the bytes the devices needed. The floor of a blocked time is the device-to-host copy:
every addressable shard copied into host memory.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.jax import AsyncPytreeSaver, ReadStats, load_pytree, save_pytree
from ckptstore.tools.timing import fsync_tree, measure, print_table, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="1G")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    total = sizes([args.size])[0]
    mesh8 = Mesh(np.array(jax.devices()[:8]), ("d",))
    mesh4 = Mesh(np.array(jax.devices()[:4]), ("d",))
    columns = 4096
    rows = max(8, total // 8 // 4 // columns // 8 * 8)
    sharded = NamedSharding(mesh8, P("d"))
    tree = {
        f"layer{i}": jax.device_put(
            jax.random.normal(jax.random.key(i), (rows, columns), jnp.float32), sharded
        )
        for i in range(8)
    }
    size = sum(leaf.nbytes for leaf in tree.values())
    four = NamedSharding(mesh4, P("d"))
    same = {
        name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharded) for name, a in tree.items()
    }
    onto4 = {
        name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=four) for name, a in tree.items()
    }

    root = tempfile.mkdtemp(prefix="ckpt-jax-")
    store = ckptstore.open(f"{root}/store")
    saver = AsyncPytreeSaver(store)
    orbax = ocp.StandardCheckpointer()
    orbax_async = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    step = [0]

    def next_step() -> int:
        step[0] += 1
        return step[0]

    def ours_save(repeat: int) -> None:
        save_pytree(store, next_step(), tree)

    def orbax_save(repeat: int) -> None:
        orbax.save(f"{root}/orbax-{next_step()}", tree)
        orbax.wait_until_finished()

    def orbax_save_fsynced(repeat: int) -> None:  # durable, as a published ckptstore save is
        path = f"{root}/orbax-{next_step()}"
        orbax.save(path, tree)
        orbax.wait_until_finished()
        fsync_tree(path)

    def clean_page_cache(name: str, repeat: int) -> None:  # no contender flushes another's
        os.sync()

    def drop_old(name: str, repeat: int) -> None:  # keep the newest of each, for the restores
        for step_number in store.steps()[:-1]:
            store.delete(step_number)
        saved = sorted(
            (int(entry.split("-")[1]), entry)
            for entry in os.listdir(root)
            if entry.startswith("orbax-")
        )
        for _, entry in saved[:-1]:
            shutil.rmtree(f"{root}/{entry}")

    saves = measure(
        {"Orbax save": orbax_save, "Orbax save, then fsync": orbax_save_fsynced,
         "ckptstore save": ours_save},
        args.repeats,
        before=clean_page_cache,
        after=drop_old,
    )  # fmt: skip
    print_table(f"Save of {size / 2**30:.2f} GiB, 8 devices, to a local directory", saves,
                "Orbax save", size)  # fmt: skip

    newest_orbax = max(
        (entry for entry in os.listdir(root) if entry.startswith("orbax-")),
        key=lambda entry: int(entry.split("-")[1]),
    )
    checkpoint = store.latest()
    assert checkpoint is not None
    stats: list[ReadStats] = []

    def ours_restore(target: Any) -> Any:
        def run(repeat: int) -> None:
            counted = ReadStats()
            restored = load_pytree(checkpoint, target, stats=counted)
            jax.block_until_ready(restored)
            if target is onto4:
                stats.append(counted)

        return run

    def orbax_restore(target: Any) -> Any:
        def run(repeat: int) -> None:
            jax.block_until_ready(orbax.restore(f"{root}/{newest_orbax}", target))

        return run

    restores = measure(
        {"Orbax restore": orbax_restore(same), "ckptstore restore": ours_restore(same),
         "Orbax restore onto 4 devices": orbax_restore(onto4),
         "ckptstore restore onto 4 devices": ours_restore(onto4)},
        args.repeats,
    )  # fmt: skip
    print_table(f"Restore of {size / 2**30:.2f} GiB (page cache warm)", restores,
                "Orbax restore", size)  # fmt: skip
    read = stats[-1]
    print(f"ckptstore, onto 4 devices: read {read.read / 2**20:.1f} MiB for "
          f"{read.needed / 2**20:.1f} MiB needed ({read.read / read.needed:.3f}x), in "
          f"{read.requests} ranged reads\n")  # fmt: skip

    floor = {
        (name, index): np.empty(shard.data.shape, leaf.dtype)
        for name, leaf in tree.items()
        for index, shard in enumerate(leaf.addressable_shards)
    }

    def host_copy(repeat: int) -> None:  # every shard into host memory that is already there
        for leaf in tree.values():
            for shard in leaf.addressable_shards:
                shard.data.copy_to_host_async()
        for name, leaf in tree.items():
            for index, shard in enumerate(leaf.addressable_shards):
                np.copyto(floor[name, index], np.asarray(shard.data))

    def ours_async(repeat: int) -> None:
        saver.save(next_step(), tree)

    def orbax_async_save(repeat: int) -> None:
        orbax_async.save(f"{root}/orbax-{next_step()}", args=ocp.args.StandardSave(tree))

    def settle(name: str, repeat: int) -> None:
        saver.wait()
        orbax_async.wait_until_finished()
        drop_old(name, repeat)

    blocked = measure(
        {"device-to-host copy": host_copy, "Orbax async save (blocked)": orbax_async_save,
         "ckptstore async save (blocked)": ours_async},
        args.repeats,
        after=settle,
    )  # fmt: skip
    print_table(f"Trainer blocked by an async save of {size / 2**30:.2f} GiB", blocked,
                "device-to-host copy", size)  # fmt: skip
    saver.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
