"""Side-by-side measurement: contenders alternate within one run, medians and ratios printed.

Machines here are noisy, so every benchmark runs ckptstore and its baselines in the same
process, interleaved (the order rotates every repeat), and reports the median of the repeats
and each contender's ratio against the named baseline (> 1 is faster than the baseline).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Result", "evict", "fsync_tree", "measure", "print_table", "sizes"]


@dataclass
class Result:
    """Every repeat's seconds for one contender."""

    name: str
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)


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
            if after is not None:
                after(name, repeat)
    return results


def print_table(
    title: str,
    results: dict[str, Result],
    baseline: str,
    size_bytes: int | None = None,
    out: Callable[[str], object] = print,
) -> list[str]:
    """Print (and return) a table: median and best time, throughput, ratios to the baseline.

    Both ratios are printed: on a machine whose storage is shared, slow repeats come in bursts
    that hit every contender (the distribution is bimodal), and the best of the repeats then
    says more about the code than the median of few repeats does.
    """
    base, base_best = results[baseline].median, results[baseline].best
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    lines = [f"### {title}", "", f"load average (1, 5, 15 min) at the end: {load}", "",
             f"| contender | median | best | worst | throughput (best) | vs {baseline} (median) "
             f"| (best) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for result in results.values():
        rate = f"{size_bytes / result.best / 2**30:.2f} GiB/s" if size_bytes else "-"
        lines.append(
            f"| {result.name} | {result.median * 1000:.1f} ms | {result.best * 1000:.1f} ms | "
            f"{max(result.seconds) * 1000:.1f} ms | {rate} | {base / result.median:.2f}x | "
            f"{base_best / result.best:.2f}x |"
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


def sizes(text: Sequence[str]) -> list[int]:
    """Parse sizes like 64M, 2G."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return [int(float(t[:-1]) * units[t[-1].upper()]) if t[-1].isalpha() else int(t) for t in text]
