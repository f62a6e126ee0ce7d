"""Run the suite on several targets, some at once; every report stays whole and in order.

Each target runs in a thread of its own (``jobs`` at a time): most of a run on networked
storage is waiting for answers, and the embedded defaults (a directory, memory, and two
stores on one moto server, a process of its own) share two cores well. ``on_layer`` gets the
reports as they stand, in target order, after any target finished a layer, so that report
files written from it keep what every finished layer found. If the caller is interrupted
(KeyboardInterrupt), the targets still running are marked so in their reports, ``on_layer``
is called a last time, and the interruption goes on; their threads are left to the process's
exit (they are daemons: a run of the suite cannot be stopped in the middle of a storage call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ckptstore.conformance.report import INTERRUPTED, BackendReport
from ckptstore.conformance.runner import Target, run_backend
from ckptstore.urls import redact

__all__ = ["run_targets"]


def run_targets(
    targets: list[Target],
    *,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
    on_layer: Callable[[list[BackendReport]], None] | None = None,
    **options: Any,
) -> list[BackendReport]:
    """``run_backend`` on every target, ``jobs`` at a time; the reports in target order.

    ``progress`` gets each target's progress lines (prefixed with its number and URL, without
    the query, when several run at once: ``[2/8 memory://b/run] parallel races``);
    ``options`` go to ``run_backend`` (profile, budget_s, ...).
    """
    say = progress or (lambda message: None)
    written = on_layer or (lambda reports: None)
    latest: dict[int, BackendReport] = {}
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()
    slots = threading.Semaphore(max(1, jobs))
    together = jobs > 1 and len(targets) > 1

    def layer_done(index: int, report: BackendReport) -> None:
        with lock:
            latest[index] = report
            written([latest[i] for i in sorted(latest)])

    def run_one(index: int, target: Target) -> None:
        with slots:
            say(f"conformance: {redact(target.url)}")
            prefix = f"[{index + 1}/{len(targets)} {_label(target.url)}] " if together else ""
            try:
                report = run_backend(
                    target.url,
                    options=target.options,
                    progress=lambda message: say(f"{prefix}{message}"),
                    on_layer=lambda report: layer_done(index, report),
                    **options,
                )
            except BaseException as exc:  # raised in the caller's thread, below
                errors[index] = exc
            else:
                layer_done(index, report)

    threads = [
        threading.Thread(target=run_one, args=(i, t), daemon=True, name=f"conformance-{i}")
        for i, t in enumerate(targets)
    ]
    try:
        for thread in threads:
            thread.start()
            if not together:
                thread.join()
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:
        with lock:
            for index, thread in enumerate(threads):
                if thread.is_alive() and index in latest:
                    latest[index].layer_error(
                        "run",
                        INTERRUPTED,
                        "interrupted: the layers after the last shown did not run",
                    )
            written([latest[i] for i in sorted(latest)])
        raise
    for index in sorted(errors):
        raise errors[index]
    return [latest[i] for i in range(len(targets))]


def _label(url: str) -> str:
    """How a progress line names a target among several: its URL without the query (the
    options), redacted."""
    return redact(url).split("?", 1)[0]
