"""Side-by-side measurement: contenders alternate within one run, their spread and ratios printed.

Machines here are noisy, so every benchmark runs ckptstore and its baselines in the same
process, interleaved (the order rotates every repeat), and reports the min, median and max of
the repeats, the load average while they ran, and each contender's ratio of medians against
the named baseline (> 1 is faster than the baseline). ``busy`` starts CPU-bound processes
beside a measurement, as a training node has data-loader workers and other ranks.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Result",
    "busy",
    "evict",
    "fsync_tree",
    "layout",
    "measure",
    "print_table",
    "sizes",
]


@dataclass
class Result:
    """Every repeat's seconds for one contender, and the 1-minute load average after each."""

    name: str
    seconds: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def worst(self) -> float:
        return max(self.seconds)


@contextlib.contextmanager
def busy(processes: int) -> Iterator[list[int]]:
    """``processes`` CPU-bound processes (each a Python loop; their pids are yielded) run for
    the duration; they are killed and reaped on the way out, whatever happens inside."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield [spinner.pid for spinner in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def measure(
    contenders: dict[str, Callable[[int], object]],
    repeats: int,
    *,
    before: Callable[[str, int], object] | None = None,
    after: Callable[[str, int], object] | None = None,
) -> dict[str, Result]:
    """Run each contender ``repeats`` times, interleaved; ``before``/``after`` are untimed."""
    results = {name: Result(name) for name in contenders}
    names = list(contenders)
    for repeat in range(repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            if before is not None:
                before(name, repeat)
            started = time.perf_counter()
            contenders[name](repeat)
            results[name].seconds.append(time.perf_counter() - started)
            results[name].loads.append(os.getloadavg()[0])
            if after is not None:
                after(name, repeat)
    return results


def print_table(
    title: str,
    results: dict[str, Result],
    baseline: str,
    size_bytes: int | None = None,
    out: Callable[[str], object] = print,
    *,
    layout: str | None = None,
    busy: int | None = None,
) -> list[str]:
    """Print (and return) a table: min, median and max time of the repeats, the throughput of
    the median, and the ratio of medians to the baseline; above it the load average while the
    repeats ran (sampled after each), the layout and the number of busy processes beside."""
    base = results[baseline].median
    loads = sorted(load for result in results.values() for load in result.loads)
    repeats = min(len(result.seconds) for result in results.values())
    lines = [f"### {title}", ""]
    facts = [f"{repeats} interleaved repeats"]
    if layout:
        facts.append(f"layout: {layout}")
    if busy is not None:
        facts.append(f"{busy} busy process{'' if busy == 1 else 'es'} beside")
    if loads:
        facts.append(
            f"load average (1 min) during the run: {loads[0]:.2f} to {loads[-1]:.2f}, "
            f"median {statistics.median(loads):.2f}"
        )
    lines += ["; ".join(facts), ""]
    lines += [
        f"| contender | min | median | max | throughput (median) | vs {baseline} (median) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for result in results.values():
        rate = f"{size_bytes / result.median / 2**30:.2f} GiB/s" if size_bytes else "-"
        lines.append(
            f"| {result.name} | {result.best * 1000:.1f} ms | {result.median * 1000:.1f} ms | "
            f"{result.worst * 1000:.1f} ms | {rate} | {base / result.median:.2f}x |"
        )
    out("\n".join(lines) + "\n")
    return lines


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (for baselines that do not)."""
    for directory, _, files in os.walk(path):
        for name in [*files, ""]:  # "": the directory itself, after its files
            _with_open(os.path.join(directory, name), os.fsync)


def evict(path: str) -> None:
    """Drop ``path``'s files from the page cache, so that loads read the disk."""

    def drop(fd: int) -> None:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    for directory, _, files in os.walk(path):
        for name in files:
            _with_open(os.path.join(directory, name), drop)


def _with_open(path: str, action: Callable[[int], object]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        action(fd)
    finally:
        os.close(fd)


def layout(count: int, each: int) -> str:
    """``count`` pieces of ``each`` bytes, as a table's layout line says it: ``8 x 128 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if each >= scale:
            return f"{count} x {each / scale:.4g} {unit}"
    return f"{count} x {each} B"


def sizes(text: Sequence[str]) -> list[int]:
    """Parse sizes like 64M, 2G."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return [int(float(t[:-1]) * units[t[-1].upper()]) if t[-1].isalpha() else int(t) for t in text]
