"""One process of a two-process JAX job (tests/test_jax_multiprocess.py).

    python tests/jax_process_worker.py PROCESS PORT STORE MODE

Each process has 4 CPU devices; the job's mesh has 8. ``save``: save step 1 of a tree of
arrays sharded over all 8 devices (each process writes what it holds), then load the latest
onto a 2x4 mesh and check every addressable shard. ``die``: process 1 exits mid-write of step 2
(after its first shard); process 0 must publish nothing. ``one-fails``: process 1's tree has
a leaf that cannot be stored: both fail step 1 at once, and steps 2 and 3 publish; then process
1 saves a tree with a leaf renamed, then another step than process 0's (both refused on both);
then an asynchronous save fails and the next is refused on both, whenever each process asks
for it, and the one after publishes. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.jax import AsyncPytreeSaver, load_pytree, save_pytree

WHOLE = np.arange(256 * 32, dtype=np.float32).reshape(256, 32)
BIAS = np.arange(32, dtype=np.int32)


def tree(mesh: Mesh) -> dict[str, object]:
    rows = NamedSharding(mesh, P("d"))
    replicated = NamedSharding(mesh, P())
    return {
        "w": jax.make_array_from_callback(WHOLE.shape, rows, lambda index: WHOLE[index]),
        "b": jax.make_array_from_callback(BIAS.shape, replicated, lambda index: BIAS[index]),
        "step": 1,
        "name": "two processes",
        # on each process's own first device: every process holds a whole copy
        "count": jax.device_put(np.int32(3), jax.local_devices()[0]),
        "key": jax.random.key(5),
    }


def _outcome(save: Callable[[], object]) -> str:
    try:
        save()
    except ckptstore.CkptStoreError as exc:  # and what this process itself found, if anything
        cause = [] if exc.__cause__ is None else [type(exc.__cause__).__name__]
        return "<-".join([type(exc).__name__, *cause])
    return "published"


def main() -> int:
    process, port, url, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    store = ckptstore.open(url)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    result: dict[str, object] = {"process": process, "devices": len(jax.devices())}
    if mode == "save":
        checkpoint = save_pytree(store, 1, tree(mesh), metadata={"by": "coordinator"})
        result["saved"] = checkpoint.step
        other = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
        target = {
            "w": jax.ShapeDtypeStruct(
                WHOLE.shape, WHOLE.dtype, sharding=NamedSharding(other, P("b", "a"))
            ),
            "b": jax.ShapeDtypeStruct(
                BIAS.shape, BIAS.dtype, sharding=NamedSharding(other, P("b"))
            ),
            "step": 0,
            "name": "",
            "count": jax.device_put(np.int32(0), jax.local_devices()[0]),
            "key": jax.random.key(0),
        }
        loaded = load_pytree(store, target)
        assert int(loaded["count"]) == 3
        assert np.array_equal(
            jax.random.key_data(loaded["key"]), jax.random.key_data(jax.random.key(5))
        )
        for name, whole in (("w", WHOLE), ("b", BIAS)):
            for shard in loaded[name].addressable_shards:  # type: ignore[attr-defined]
                assert np.array_equal(np.asarray(shard.data), whole[shard.index]), name
        result["loaded"] = [loaded["step"], loaded["name"]]
        result["shards"] = sorted(store.latest().names)  # type: ignore[union-attr]
    elif mode == "one-fails":  # process 1's tree cannot be stored; the job goes on after it
        bad = dict(tree(mesh), extra=object() if process == 1 else 1)
        try:
            save_pytree(store, 1, bad, timeout_s=30)
            result["first"] = "published"
        except ckptstore.CkptStoreError as exc:
            result["first"] = type(exc).__name__
        for step in (2, 3):
            save_pytree(store, step, tree(mesh), timeout_s=30)
        result["steps"] = store.steps()
        # process 1 saves another tree (a leaf renamed), then another step: refused on both
        renamed = tree(mesh)
        if process == 1:
            renamed["w2"] = renamed.pop("w")
        result["renamed"] = _outcome(lambda: save_pytree(store, 4, renamed, timeout_s=30))
        step = 5 if process == 1 else 4
        result["other step"] = _outcome(lambda: save_pytree(store, step, tree(mesh), timeout_s=30))
        # an asynchronous save fails in the background (step 3 exists); process 0 asks for the
        # next save after it failed, process 1 while it may still be in flight: both refuse it,
        # and the save after that publishes (each call is one coordinated save on each process)
        with AsyncPytreeSaver(store, timeout_s=30) as saver:
            failing = saver.save(3, tree(mesh))
            if process == 0:
                result["in background"] = type(failing.exception()).__name__
            result["after it"] = _outcome(lambda: saver.save(6, tree(mesh)))
            saver.save(7, tree(mesh)).result()
        result["steps after"] = store.steps()
    else:
        if process == 1:
            from ckptstore.pending import PendingCheckpoint

            real = PendingCheckpoint.write

            def write_then_die(self: PendingCheckpoint, name: str, data: object) -> object:
                record = real(self, name, data)  # type: ignore[arg-type]
                os._exit(17)  # dead before the shards are sealed and the receipts sent
                return record

            PendingCheckpoint.write = write_then_die  # type: ignore[method-assign]
        try:
            save_pytree(store, 2, tree(mesh), timeout_s=8)
            result["published"] = True
        except ckptstore.CkptStoreError as exc:
            result["error"] = str(exc)[:300]
        result["steps"] = store.steps()
    print(json.dumps(result), flush=True)
    if mode != "die":
        jax.distributed.shutdown()  # both alive: neither may leave while the other works
        return 0
    os._exit(0)  # not jax.distributed.shutdown(): it would wait for the dead peer


if __name__ == "__main__":
    sys.exit(main())
