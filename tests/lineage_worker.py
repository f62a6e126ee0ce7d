"""A writer process for the lineage tests: the old run (the zombie) or the run that took over.

Usage: ``python lineage_worker.py ROLE URL OPTIONS_JSON CONTROL_DIR``. It reports each outcome
as one line on stdout (``published 3 epoch 1``, ``superseded 6: <the error>``) and waits for
files the test creates in CONTROL_DIR where the test needs it held (never for a time):

- ``zombie``: saves steps 1 to 4; at step 5 it passes the superseded-writer check, says
  ``at commit point 5`` and waits for ``commit-5`` (the takeover happens meanwhile), then
  publishes it (the race the readers' rule covers); then saves steps 6 to 8, each refused.
- ``new``: takes the store over from step 2, saves step 3, says so and waits for ``clash``;
  then saves steps 5 and 6 (step 5: the name the zombie published after the takeover).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import ckptstore
from ckptstore.errors import SupersededError

WAIT_S = 120.0


def wait_for(path: str) -> None:
    """Until the test creates ``path`` (bounded: a test that never does fails, not hangs)."""
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"{path} never appeared")
        time.sleep(0.005)


def say(line: str) -> None:
    print(line, flush=True)


def shards(role: str, step: int) -> dict[str, bytes]:
    return {"model.bin": f"{role} {step}".encode() * 100}


def zombie(store: Any, control: str) -> None:
    for step in range(1, 5):
        store.save(step, shards("zombie", step), {"writer": "zombie"})
        say(f"published {step} epoch {store.epoch}")
    publish = store.strategy.publish

    def held_at_the_commit_point(manifest: Any) -> None:
        say(f"at commit point {manifest.step}")
        wait_for(os.path.join(control, f"commit-{manifest.step}"))
        publish(manifest)

    store.strategy.publish = held_at_the_commit_point
    store.save(5, shards("zombie", 5), {"writer": "zombie"})
    say(f"published 5 epoch {store.epoch}")
    del store.strategy.publish
    for step in range(6, 9):
        try:
            store.save(step, shards("zombie", step), {"writer": "zombie"})
        except SupersededError as exc:
            say(f"superseded {step}: {exc}")
        else:
            say(f"published {step} epoch {store.epoch}")
    say("done")


def new_run(store: Any, control: str) -> None:
    epoch = store.take_over(2, note="lineage test")
    say(f"took epoch {epoch.number}")
    store.save(3, shards("new", 3), {"writer": "new"})
    say(f"published 3 epoch {store.epoch}")
    wait_for(os.path.join(control, "clash"))
    for step in (5, 6):
        store.save(step, shards("new", step), {"writer": "new"})
        say(f"published {step} epoch {store.epoch}")
    say("done")


def main() -> None:
    role, url, options, control = sys.argv[1:5]
    store = ckptstore.open(url, **json.loads(options))
    (zombie if role == "zombie" else new_run)(store, control)


if __name__ == "__main__":
    main()
