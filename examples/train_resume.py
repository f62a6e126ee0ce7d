"""Train a small model, checkpoint every N steps with ckptstore, and resume after any crash.

    python examples/train_resume.py --store /tmp/run --steps 200 --save-every 20 [--async]

Kill it at any moment (SIGKILL included) and run the same command again: it resumes from the
newest complete checkpoint and ends with exactly the parameters, optimizer state and loss log
of a run that was never interrupted. Everything that decides the next step is in the
checkpoint: model, AdamW moments, the warmup + cosine LR schedule, the shuffling sampler's
position, every RNG, and the counters (samples read, successful and skipped updates).

It prints one line per event, flushed at once: "saving N" when a save of step N begins,
"snapshot N" (with --async) when the state is copied and training goes on, and "saved N" only
once checkpoint N is published: a restart from then on resumes at step N or later.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

import ckptstore
from ckptstore.torch import AsyncSaver, encode_state, load_state, save_state


class ShufflingSampler:
    """Yields dataset indices in a fresh random order each epoch; resumable mid-epoch."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch, self.position = size, seed, 0, 0

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def next_batch(self, batch_size: int) -> list[int]:
        order, batch = self._order(), []
        while len(batch) < batch_size:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order()
            batch.append(order[self.position])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]


class History:
    """The per-step loss log, kept in the checkpoint so that it survives restarts exactly."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = list(state["losses"])


def warmup_cosine(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


_say_lock = threading.Lock()


def say(line: str) -> None:
    """Print one whole line at once: an async save's "saved" comes from another thread."""
    with _say_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def say_when_published(future: Future[ckptstore.Checkpoint]) -> None:
    """Print "saved N" when the background save has published N (never at the snapshot)."""
    error = future.exception()
    if error is None:
        say(f"saved {future.result().step}")
    else:  # the next save raises it too; say so now, next to the step it belongs to
        print(f"save failed: {error!r}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL or directory")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--result", help="write the final state's digest here (JSON)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    inputs = torch.randn(2048, 32)
    targets = (inputs @ torch.randn(32, 1)).squeeze(1) + 0.1 * torch.randn(2048)

    model = nn.Sequential(nn.Linear(32, args.width), nn.GELU(), nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(20, args.steps))
    sampler, history = ShufflingSampler(len(inputs), seed=1), History()
    components = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                  "sampler": sampler, "history": history}  # fmt: skip
    counters = {"samples_read": 0, "successful_updates": 0, "skipped_updates": 0}

    store = ckptstore.open(args.store, retention=ckptstore.KeepLast(3))
    latest = store.latest()
    step = 0
    if latest is not None:
        counters = load_state(latest, components)["counters"]
        step = latest.step
        say(f"resumed from step {step}")
    # This run owns the store from here: a zombie of an earlier run (still saving after a
    # requeue) can no longer publish into the history this run continues.
    # A fresh start only where the store holds no history: if latest() is None over
    # checkpoints (all damaged, say), take_over refuses rather than discard them.
    epoch = store.take_over(
        resumed_from=None if latest is None else latest.step, discard_history=False
    )
    say(f"took over the store as epoch {epoch.number}")
    saver = AsyncSaver(store, max_in_flight=1) if args.use_async else None

    while step < args.steps:
        batch = sampler.next_batch(64)
        dropout_mask = (torch.rand(64) > 0.1).float()  # uses the RNG: restored exactly
        prediction = model(inputs[batch]).squeeze(1)
        loss = (((prediction - targets[batch]) ** 2) * dropout_mask).mean()
        optimizer.zero_grad()
        loss.backward()
        if torch.isfinite(loss):
            optimizer.step()
            counters["successful_updates"] += 1
        else:
            counters["skipped_updates"] += 1
        scheduler.step()
        history.losses.append(loss.item())
        counters["samples_read"] += len(batch)
        step += 1
        if step % args.save_every == 0 or step == args.steps:
            say(f"saving {step}")
            if saver is not None:
                future = saver.save(step, components, counters=counters)
                say(f"snapshot {step}")  # copied: training goes on, nothing is published yet
                future.add_done_callback(say_when_published)
            else:
                save_state(store, step, components, counters=counters)
                say(f"saved {step}")
    if saver is not None:
        saver.close()  # waits for the saves in flight (their "saved" lines come first)

    if args.result:
        tensors, skeleton = encode_state(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        )
        digest = {
            "step": step,
            "state_sha256": hashlib.sha256(tensors + skeleton).hexdigest(),
            "losses": [float.hex(x) for x in history.losses],
            "counters": counters,
        }
        with open(args.result, "w", encoding="utf-8") as handle:
            json.dump(digest, handle)
    say(f"done at step {step} in {time.process_time():.1f}s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
