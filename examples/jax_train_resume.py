"""Train a small Flax model on 8 (simulated) devices, checkpoint with ckptstore, resume after
any crash, bitwise exact.

    python examples/jax_train_resume.py --store /tmp/jax-run --steps 60 --save-every 5 [--async]

The model's first kernel is sharded over a 4x2 mesh's "model" axis, each batch over its "data"
axis. Kill it at any moment (SIGKILL included) and run the same command again: it resumes from
the newest complete checkpoint and ends with exactly the parameters, Adam moments, PRNG key
and loss log of a run that was never interrupted. It prints "saving N" when a save of step N
begins, "snapshot N" (with --async) when the arrays are copied and training goes on, and
"saved N" only once checkpoint N is published.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import hashlib
import json
import sys
import threading
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
from ckptstore.jax import AsyncPytreeSaver, load_pytree, save_pytree


class Regressor(linen.Module):
    width: int = 64

    @linen.compact
    def __call__(self, x: Any, *, rng: Any) -> Any:
        hidden = linen.gelu(linen.Dense(self.width)(x))
        keep = jax.random.bernoulli(rng, 0.9, hidden.shape)  # dropout: uses the saved key
        return linen.Dense(1)(jnp.where(keep, hidden / 0.9, 0.0)).squeeze(-1)


_say_lock = threading.Lock()


def say(line: str) -> None:
    """Print one whole line at once: an async save's "saved" comes from another thread."""
    with _say_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def say_when_published(future: Future[ckptstore.Checkpoint]) -> None:
    error = future.exception()
    if error is None:
        say(f"saved {future.result().step}")
    else:
        print(f"save failed: {error!r}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL or directory")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--result", help="write the final state's digest here (JSON)")
    args = parser.parse_args(argv)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    data = np.random.default_rng(0)
    inputs = data.standard_normal((2048, 16), dtype=np.float32)
    targets = inputs @ data.standard_normal(16, dtype=np.float32) + 0.1 * data.standard_normal(
        2048, dtype=np.float32
    )
    model = Regressor()
    params = model.init(jax.random.key(0), jnp.ones((1, 16)), rng=jax.random.key(1))

    def placed(path: Any, leaf: Any) -> Any:  # the first kernel over "model", the rest copied
        spec = P(None, "model") if "Dense_0" in str(path) and leaf.ndim == 2 else P()
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    params = jax.tree_util.tree_map_with_path(placed, params)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, args.steps)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(schedule))
    tree: dict[str, Any] = {
        "train": state,
        "rng": jax.random.key(2),
        "losses": np.zeros(args.steps, np.float32),
        "samples_read": 0,
    }

    store = ckptstore.open(args.store, retention=ckptstore.KeepLast(3))
    latest = store.latest()
    if latest is not None:
        tree = load_pytree(latest, tree)  # onto the shardings of the tree made above
        say(f"resumed from step {latest.step}")
    # This run owns the store from here: a zombie of an earlier run can no longer publish.
    store.take_over(resumed_from=None if latest is None else latest.step)
    saver = AsyncPytreeSaver(store) if args.use_async else None

    batch_sharding = NamedSharding(mesh, P("data"))

    @jax.jit
    def train_step(state: TrainState, rng: Any, x: Any, y: Any) -> tuple[TrainState, Any]:
        def loss_fn(params: Any) -> Any:
            return jnp.mean((state.apply_fn(params, x, rng=rng) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    step = int(tree["train"].step)
    while step < args.steps:
        rng, batch_key, dropout_key = jax.random.split(tree["rng"], 3)
        batch = np.asarray(jax.random.choice(batch_key, len(inputs), (64,), replace=False))
        x = jax.device_put(inputs[batch], batch_sharding)
        y = jax.device_put(targets[batch], batch_sharding)
        train, loss = train_step(tree["train"], dropout_key, x, y)
        losses = tree["losses"].copy()
        losses[step] = np.float32(loss)
        tree = {"train": train, "rng": rng, "losses": losses,
                "samples_read": tree["samples_read"] + len(batch)}  # fmt: skip
        step += 1
        if step % args.save_every == 0 or step == args.steps:
            say(f"saving {step}")
            if saver is not None:
                future = saver.save(step, tree)
                say(f"snapshot {step}")  # copied: training goes on, nothing published yet
                future.add_done_callback(say_when_published)
            else:
                save_pytree(store, step, tree)
                say(f"saved {step}")
    if saver is not None:
        saver.close()

    if args.result:
        digest = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves((tree["train"].params, tree["train"].opt_state)):
            digest.update(np.asarray(leaf).tobytes())
        digest.update(np.asarray(jax.random.key_data(tree["rng"])).tobytes())
        result = {
            "step": step,
            "state_sha256": digest.hexdigest(),
            "losses": [float(x).hex() for x in tree["losses"]],
            "samples_read": tree["samples_read"],
        }
        with open(args.result, "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    say(f"done at step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
