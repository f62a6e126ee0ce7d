"""The LATEST hint's format: one step in ASCII decimal; anything else is ignored, never obeyed.

The hint only saves a reader a full listing. A hint that is unreadable, names no step, or is a
file of the wrong kind (a directory, a FIFO) is treated as absent: the reader lists every step
and the next publish rewrites it. It is reported with one warning per store and value, not on
every read.
"""

from __future__ import annotations

import logging
import re
import threading

from ckptstore.names import MAX_STEP

__all__ = ["MAX_HINT_BYTES", "encode_hint", "ignore_hint", "parse_hint", "report_lagging_listing"]

log = logging.getLogger(__name__)

MAX_HINT_BYTES = 64
# ASCII digits only: int() also accepts '1_000', ' ١٢ ' (Arabic-Indic) and '+5'.
_HINT_RE = re.compile(rb"[0-9]{1,20}\n?", re.ASCII)
_warned: set[tuple[str, str]] = set()
_lagging: set[str] = set()
_warned_lock = threading.Lock()


def encode_hint(step: int) -> bytes:
    """Return the stored form of a hint naming ``step``."""
    return f"{step}\n".encode("ascii")


def parse_hint(data: bytes, *, where: str) -> int | None:
    """Return the step a stored hint names, or None (with one warning) if it names none."""
    match = _HINT_RE.fullmatch(data)
    step = int(match.group(0)) if match else None
    if step is None or step > MAX_STEP:
        ignore_hint(where, f"it holds {data[:MAX_HINT_BYTES]!r}, not a step")
        return None
    return step


def ignore_hint(where: str, why: str) -> None:
    """Warn, once per hint and reason, that a hint is ignored (readers list every step)."""
    with _warned_lock:
        if (where, why) in _warned:
            return
        _warned.add((where, why))
    log.warning(
        "%s: ignoring the LATEST hint: %s; readers list every step until a publish rewrites it",
        where,
        why,
    )


def report_lagging_listing(url: str, step: int, why: str) -> None:
    """Warn, once per store, that a listing did not show ``step``, which ``why`` (the LATEST
    hint, an epoch's parent) named before the listing began and a direct read found."""
    with _warned_lock:
        if url in _lagging:
            return
        _lagging.add(url)
    log.warning(
        "%s: lagging listing: a listing of checkpoints did not show step %d, which %s named "
        "before the listing began and which a direct read found published. This storage's "
        "listings lag behind writes or end early; ckptstore reads such steps directly, lists "
        "again past where the listing ended, and deletes nothing on such a listing's word "
        "(reported once)",
        url,
        step,
        why,
    )
