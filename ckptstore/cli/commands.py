"""The ``ckptstore`` command: ls, show, verify, gc, delete, rollback, push, pull, bench,
advise, lifecycle, repair-epoch, conformance and demo.

Every command but ``demo`` takes store URLs (or bare paths), and ``--json`` prints its result
as JSON on stdout (``conformance`` also writes report files: ``--json-file``, ``--junit``).
Every error, bad arguments included, prints one line, ``ckptstore: error: ...``, and exits with
status 2; with ``--json`` stdout also gets a JSON object
``{"error": message, "type": error class}``, so a script can parse every outcome. ``verify``
exits with status 1 when a checkpoint is broken. Anything read from storage (a shard name, a
writer's host, a stray entry's name) is printed with its control, format (bidi) and separator
characters escaped, so what an operator reads is what is stored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn, TextIO

from ckptstore import registry
from ckptstore.checkpoint import Checkpoint
from ckptstore.cli.directory import add_directory_commands
from ckptstore.cli.keys import add_key_options, key_options
from ckptstore.cli.lineage import (
    ancestry,
    ancestry_text,
    epoch_document,
    epoch_rows,
    superseded_document,
    superseded_rows,
)
from ckptstore.cli.output import write_result
from ckptstore.cli.progress import ProgressBar
from ckptstore.cli.repair import add_repair_command
from ckptstore.cli.tiers import (
    open_pair,
    outside_rows,
    pair_document,
    refuse_a_fast_tier_alone,
)
from ckptstore.commit.base import FileId
from ckptstore.errors import (
    BackendUnavailableError,
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    InvalidInputError,
    InvalidOptionError,
    NotACheckpointError,
    StorageError,
    UntrustedCheckpointError,
)
from ckptstore.interface import CheckpointStore
from ckptstore.interval import DEFAULT_RECENT, MIN_SAVES, advise
from ckptstore.manifest import Manifest
from ckptstore.names import MAX_STEP
from ckptstore.sharing import StorageUse, storage_use
from ckptstore.signing import generate_key, write_key_pair
from ckptstore.store import DEFAULT_GRACE, DEFAULT_SUPERSEDED_GRACE, Store, open_store
from ckptstore.tiers.replication import shown_url
from ckptstore.tiers.tiered import split_tiered_url
from ckptstore.urls import redact

__all__ = ["build_parser", "main", "parse_duration"]

EXIT_OK, EXIT_BROKEN, EXIT_ERROR = 0, 1, 2
# ASCII digits, whole string: ``\d`` would take Arabic-Indic digits and ``$`` a trailing newline.
_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", re.ASCII)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DAYS = 36500
"""The longest duration or day count any option takes (100 years): a larger one is a typo, and
timedelta and datetime arithmetic overflow not far above it."""
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([KMG]?)", re.ASCII | re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
STRAY = "stray (not a checkpoint, left alone)"
VANISHED = "vanished (deleted while being read)"


def parse_duration(text: str) -> timedelta:
    """Parse ``90``, ``90s``, ``15m``, ``1h`` or ``2d`` into a timedelta of at most 100 years."""
    match = _DURATION_RE.fullmatch(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid duration {_shown(text)} (examples: 30s, 15m, 1h, 2d)"
        )
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    # Bounded before timedelta(): 99999999999d overflows it, and 400 digits make a float inf.
    if not seconds <= MAX_DAYS * 86400:
        raise argparse.ArgumentTypeError(
            f"duration {_shown(text)} is longer than {MAX_DAYS} days (100 years)"
        )
    return timedelta(seconds=seconds)


def parse_positive_duration(text: str) -> timedelta:
    """Like ``parse_duration``, but longer than zero (a mean time between interruptions)."""
    duration = parse_duration(text)
    if duration <= timedelta(0):
        raise argparse.ArgumentTypeError(
            f"duration {_shown(text)} is zero: it must be longer than 0 s (30s, 15m, 6h, 2d...)"
        )
    return duration


def parse_step(text: str) -> int:
    """Parse a step: ASCII decimal digits, in [0, 10**20)."""
    significant = text.lstrip("0") or "0"
    # Length first: int() refuses more than 4300 digits (leading zeros included).
    if not re.fullmatch(r"[0-9]+", text, re.ASCII) or len(significant) > len(str(MAX_STEP)):
        raise argparse.ArgumentTypeError(
            f"invalid step {_shown(text)}: a whole number in [0, {MAX_STEP}]"
        )
    return int(significant)  # at most 20 digits: never above MAX_STEP


def counted(low: int, high: int) -> Callable[[str], int]:
    """Return a parser of whole numbers (ASCII digits) in [low, high]."""

    def parse(text: str) -> int:
        digits = text.strip()
        # Length first: int() of thousands of digits is slow, and refused past 4300.
        if not re.fullmatch(r"[0-9]{1,12}", digits, re.ASCII) or not low <= int(digits) <= high:
            raise argparse.ArgumentTypeError(
                f"invalid value {_shown(text)}: a whole number from {low} to {high}"
            )
        return int(digits)

    return parse


def parse_size(text: str) -> int:
    """Parse a byte count like ``4096``, ``64K``, ``256M`` or ``2G`` (at least one byte)."""
    match = _SIZE_RE.fullmatch(text.strip())
    size = 0
    if match:
        size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"invalid size {_shown(text)}: use a size like 256M or 2G")
    limit = _bench_memory_limit()
    if size > limit:
        raise argparse.ArgumentTypeError(
            f"size {_shown(text)} is more than this machine can hold twice in memory "
            f"(at most {human_size(limit)})"
        )
    return size


def _bench_memory_limit() -> int:
    """Half the physical memory: bench holds the data it saves and the buffers it loads into."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):
        return 2**40


def _output_file(text: str) -> str:
    """An output path whose directory exists: checked before a run of minutes, not after it."""
    directory = os.path.dirname(os.path.abspath(text)) if text else ""
    if not text or not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"cannot write {_shown(text)}: no such directory")
    return text


def _shown(text: str, limit: int = 40) -> str:
    """``text`` quoted for an error message: escaped, and cut short if it is long."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def printable(text: str) -> str:
    """Return ``text`` with every character a terminal does not show as itself escaped.

    Control (``\\n``, ``\\x1b``, NEL ``\\x85``), format (bidi override ``\\u202e``, zero-width)
    and separator (``\\u2028``) characters become Python escapes: a name or message read from
    storage cannot end, recolour, hide or reorder a line of output.
    """
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape", "backslashreplace").decode("ascii")
        for ch in text
    )


def human_size(size: int) -> str:
    """Format a byte count with binary units: ``1.5 GiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _open(url: str, args: argparse.Namespace | None = None) -> Store:
    return open_store(url, create=False, **key_options(args))


def _take_tier_options(args: argparse.Namespace) -> None:
    """A tiered store's URL (``?replicate_to=DURABLE``, ``ckptstore.tiered_url``) given to a
    command: the command's ``--replicate-to`` form (``replication=`` is the writer's, and
    ignored: a command never copies). A command that works on one store refuses it, naming
    the two URLs to run it on."""
    urls = getattr(args, "urls", None)
    if urls is not None:  # conformance URL... [--replicate-to DURABLE]
        tiered = [(index, split_tiered_url(url)) for index, url in enumerate(urls)]
        tiered = [(index, found) for index, found in tiered if found[1]]
        if not tiered:
            return
        if len(urls) != 1:
            raise InvalidInputError(
                "conformance runs a tiered pair alone: give its URL (or URL --replicate-to "
                "DURABLE_URL) and no other"
            )
        fast, options = tiered[0][1]
        if "replicate_to" not in options:
            raise InvalidOptionError(f"{redact(urls[0])}: replication needs replicate_to=URL")
        _agree(args, options["replicate_to"])
        args.urls = [fast]
        return
    url = getattr(args, "url", None)
    if not isinstance(url, str) or getattr(args, "takes_tiered_url", False):
        return  # push and pull open a tiered URL themselves
    fast, options = split_tiered_url(url)
    if "replicate_to" not in options:
        if options:  # replication= alone
            raise InvalidOptionError(f"{redact(url)}: replication needs replicate_to=DURABLE_URL")
        return
    if not hasattr(args, "replicate_to"):
        raise InvalidInputError(
            f"ckptstore {args.command} works on one store, and {redact(url)} names a tiered "
            f"pair: run it on the fast tier ({redact(fast)}) and on the durable tier "
            f"({redact(options['replicate_to'])}) apart"
        )
    _agree(args, options["replicate_to"])
    args.url = fast


def _agree(args: argparse.Namespace, durable: str) -> None:
    if args.replicate_to is not None and args.replicate_to != durable:
        raise InvalidOptionError(
            f"the URL says replicate_to={redact(durable)!r}, --replicate-to "
            f"{redact(args.replicate_to)!r}: give one"
        )
    args.replicate_to = durable


def _print_table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")


def _summary(checkpoint: Checkpoint) -> dict[str, Any]:
    return {
        "step": checkpoint.step,
        "committed_at": checkpoint.committed_at.isoformat(),
        "size": checkpoint.size,
        "shards": len(checkpoint.shards),
        "epoch": checkpoint.manifest.epoch,
        "status": "ok",
    }


def _entry(store: Store, step: int) -> tuple[dict[str, Any], Checkpoint | None]:
    """What the entry named like ``step`` is, and its checkpoint if it is a complete one.

    Never raises for one entry: a stray, a checkpoint deleted since the listing, a damaged or
    an unreadable one is reported as such, so one entry cannot hide the others.
    """
    try:
        checkpoint = store.get(step)
    except NotACheckpointError as exc:
        return {"step": step, "status": "stray", "problem": str(exc)}, None
    except CheckpointNotFoundError as exc:
        # Still listed, yet not found: an entry that never was a checkpoint (a plain file
        # named like a step), not one deleted since the listing.
        status = "stray" if step in _listed_steps(store) else "vanished"
        return {"step": step, "status": status, "problem": str(exc)}, None
    except UntrustedCheckpointError as exc:  # under --trust: not signed by a trusted key
        return {"step": step, "status": "untrusted", "problem": str(exc)}, None
    except IntegrityError as exc:
        return {"step": step, "status": "broken", "problem": str(exc)}, None
    except StorageError as exc:
        return {"step": step, "status": "unreadable", "problem": str(exc)}, None
    return _summary(checkpoint), checkpoint


def _listed_steps(store: Store) -> list[int]:
    """Every step an entry of the store is named after: checkpoints and strays alike.

    Store.steps() counts only checkpoints whose manifest parses; ls and verify also show the
    entries it leaves out (strays, damaged manifests), each for what it is.
    """
    return store.named_steps()


def _status_text(entry: dict[str, Any]) -> str:
    status = entry["status"]
    if status == "stray":
        return STRAY
    if status == "vanished":
        return VANISHED
    return f"{status.upper()}: {entry['problem']}"


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    """List every entry, the epochs and the superseded checkpoints; exit 0 when the listing
    itself succeeded, whatever an entry is."""
    if args.replicate_to:
        return _ls_pair(args, out)
    store = _open(args.url, args)
    found = [_entry(store, step) for step in _listed_steps(store)]
    entries = [entry for entry, _ in found]
    use = _storage_use(store, [c for _, c in found if c is not None])
    if use is not None:
        for entry, checkpoint in found:
            if checkpoint is not None:
                key = (checkpoint.step, checkpoint.manifest.epoch)
                entry["shared_bytes"] = use.shared.get(key, 0)
    lineage = store.lineage()
    superseded = store.superseded() if lineage.newest else []
    since = store.superseded_since() if superseded else {}
    for entry in entries:
        entry.setdefault("epoch", lineage.owner(entry["step"]))
    if args.json:
        document: dict[str, Any] = {
            "url": store.url,
            "checkpoints": entries,
            "epochs": [epoch_document(epoch) for epoch in lineage.epochs],
            "superseded": superseded_document(superseded, since, DEFAULT_SUPERSEDED_GRACE),
        }
        if use is not None:
            document["stored_bytes"] = use.stored
            document["listed_bytes"] = use.listed
        json.dump(document, out, indent=2)
        out.write("\n")
        return EXIT_OK
    if not entries:
        out.write(f"no checkpoints in {printable(store.url)}\n")
    else:
        _print_table(_ls_rows(entries, with_epoch=lineage.newest > 0), out)
    if use is not None:
        out.write(
            f"\nstored: {human_size(use.stored)} for checkpoints of {human_size(use.listed)} "
            f"in all (shards shared between checkpoints are stored once)\n"
        )
    if lineage.newest:  # a store never taken over shows what it always showed
        out.write("\n")
        _print_table(epoch_rows(lineage), out)
    if superseded:
        out.write("\nsuperseded (no reader returns them; a take-over from one undoes it):\n")
        _print_table(superseded_rows(superseded, since, DEFAULT_SUPERSEDED_GRACE), out)
    return EXIT_OK


def _ls_pair(args: argparse.Namespace, out: TextIO) -> int:
    """The pair's history across tiers, and the fast checkpoints outside it (§9.3, T5)."""
    pair = open_pair(args.url, args.replicate_to, **key_options(args))
    try:
        document = pair_document(pair, _summary)
    finally:
        pair.close(wait=False)
    if args.json:
        json.dump(document, out, indent=2)
        out.write("\n")
        return EXIT_OK
    where = f"{printable(document['url'])} -> {printable(document['durable_url'])}"
    entries = document["checkpoints"]
    if not entries:
        out.write(f"no checkpoints in the pair {where}\n")
    else:
        rows = _ls_rows(entries, with_epoch=True)
        rows[0].insert(2, "TIER")
        for row, entry in zip(rows[1:], entries, strict=True):
            row.insert(2, entry["tier"])
        _print_table(rows, out)
    if document["not_in_history"]:
        out.write(
            "\nnot in the history (fast tier only; the durable lineage does not hold them: "
            "never returned, replicated or counted):\n"
        )
        _print_table(outside_rows(document["not_in_history"]), out)
    return EXIT_OK


def _ls_rows(entries: list[dict[str, Any]], *, with_epoch: bool) -> list[list[str]]:
    sharing = any(entry.get("shared_bytes") for entry in entries)
    rows = [["STEP", *(["EPOCH"] if with_epoch else []), "COMMITTED (UTC)", "SIZE", "SHARDS"]]
    rows[0] += [*(["SHARED"] if sharing else []), "STATUS"]
    for entry in entries:
        epoch = [str(entry["epoch"])] if with_epoch else []
        if entry["status"] == "ok":
            committed = entry["committed_at"][:19].replace("T", " ")
            size, shards = human_size(entry["size"]), str(entry["shards"])
            shared = [human_size(entry.get("shared_bytes", 0))] if sharing else []
            rows.append([str(entry["step"]), *epoch, committed, size, shards, *shared, "ok"])
        else:
            dashes = ["-"] * (4 if sharing else 3)
            rows.append([str(entry["step"]), *epoch, *dashes, _status_text(entry)])
    return rows


def _storage_use(store: Store, checkpoints: list[Checkpoint]) -> StorageUse | None:
    """How the checkpoints share stored files, where the store's storage can say (None:
    it cannot, or nothing is shared: the listing shows what it always showed)."""
    if not checkpoints or not store.strategy.saved_incrementally():
        return None
    use = storage_use(store.strategy, [c.manifest for c in checkpoints])
    return use if use.stored < use.listed else None


def _pick(store: CheckpointStore, step: int | None) -> Checkpoint:
    if step is not None:
        return store.get(step)
    latest = store.latest()
    if latest is None:
        raise CheckpointNotFoundError(f"{store.url}: no checkpoints")
    return latest


def cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    if args.replicate_to:
        pair = open_pair(args.url, args.replicate_to, **key_options(args))
        try:
            checkpoint = _pick(pair, args.step)
            in_fast = checkpoint.url == pair.url
            tier = (
                f"fast (the pair's durable store: {shown_url(pair.durable_url)})"
                if in_fast
                else f"durable (the pair's fast store: {pair.url})"
            )
            return _show(pair.fast if in_fast else pair.durable, checkpoint, args, out, tier)
        finally:
            pair.close(wait=False)
    store = _open(args.url, args)
    return _show(store, _pick(store, args.step), args, out)


def _show(
    store: Store, checkpoint: Checkpoint, args: argparse.Namespace, out: TextIO, tier: str = ""
) -> int:
    """Print ``checkpoint`` of ``store`` (``tier``: which tier of a pair holds it)."""
    manifest = checkpoint.manifest
    lineage = store.lineage()
    chain = ancestry(lineage, manifest.step, manifest.epoch)
    if args.json:
        document = {**manifest.to_document(), "epoch": manifest.epoch, "lineage": chain}
        if tier:
            document["tier"] = tier
        json.dump(document, out, indent=2, sort_keys=True)
        out.write("\n")
        return EXIT_OK
    writer = manifest.writer
    lines = [
        f"checkpoint  step {manifest.step} in {store.url}",
        *([f"tier        {tier}"] if tier else []),
        f"attempt     {manifest.attempt} ({manifest.backend})",
        f"writer      {writer.host} pid {writer.pid}, world size {writer.world_size}",
        f"created     {manifest.created_at.isoformat()}",
        f"committed   {manifest.committed_at.isoformat()}",
        f"size        {human_size(manifest.total_size)} in {len(manifest.shards)} shard(s)"
        f"{_shared_text(store, checkpoint)}",
        f"signed      {_signer_text(store, manifest)}",
    ]
    if lineage.newest:  # a store never taken over shows what it always showed
        lines[1:1] = [
            f"epoch       {_epoch_text(chain[0])}",
            f"lineage     {ancestry_text(chain, manifest.step)}",
        ]
    if manifest.timings:
        timing = ", ".join(f"{k} {v:.3f}" for k, v in sorted(manifest.timings.items()))
        lines.append(f"timings     {timing}")
    if manifest.metadata:
        lines.append("metadata    " + json.dumps(dict(manifest.metadata), sort_keys=True)[:2000])
    out.write("\n".join(map(printable, lines)) + "\n\n")
    shown = manifest.shards if args.all_shards else manifest.shards[:50]
    rows = [["SHARD", "SIZE", "CRC32C"]]
    rows += [[s.name, human_size(s.size), s.crc32c] for s in shown]
    _print_table(rows, out)
    if len(shown) < len(manifest.shards):
        out.write(f"... and {len(manifest.shards) - len(shown)} more (--all-shards)\n")
    return EXIT_OK


def _shared_text(store: Store, checkpoint: Checkpoint) -> str:
    """How much of ``checkpoint`` other checkpoints of ``store`` share (incremental saves)."""
    if not store.strategy.saved_incrementally():
        return ""
    others = []
    for step in store.steps():
        if step != checkpoint.step:
            try:
                others.append(store.get(step))
            except (CheckpointNotFoundError, IntegrityError, StorageError):
                continue  # deleted since the listing, or unreadable: shares nothing here
    use = storage_use(store.strategy, [checkpoint.manifest, *(c.manifest for c in others)])
    shared = use.shared.get((checkpoint.step, checkpoint.manifest.epoch), 0)
    return f"; {human_size(shared)} of it shared with other checkpoints" if shared else ""


def _signer_text(store: Store, manifest: Manifest) -> str:
    """Who signed ``manifest``, and whether this reader trusts the key."""
    if manifest.signature is None:
        return "no (unsigned)"
    key = manifest.signature.key_id
    if store.trust is None:
        return f"by {key} (not checked: no --trust given)"
    return f"by {key}, trusted"  # a store with trust reads no other manifest


def _epoch_text(link: dict[str, Any]) -> str:
    if link["epoch"] == 0:
        return "0 (the store's first, never taken over)"
    parent = "a fresh start" if link["parent"] is None else f"step {link['parent']}"
    taken = link["started_at"][:19].replace("T", " ")
    by = f"{link['writer']['host']} pid {link['writer']['pid']}"
    return f"{link['epoch']}, resumed from {parent}, taken {taken} by {by}"


_STATUSES = ("ok", "broken", "unreadable", "untrusted", "vanished", "stray")
_CHECKED = _STATUSES[:4]  # the statuses of an entry that is a checkpoint


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    """Verify; exit 1 if a checkpoint is broken, else 2 if one could not be read, else 0.

    Strays and checkpoints deleted while being verified are reported and do not count; a
    named STEP that is not a checkpoint is an error.
    """
    if args.all and args.step is not None:
        raise InvalidInputError("verify takes a STEP or --all, not both")
    if args.replicate_to:
        return _verify_pair(args, out)
    store = _open(args.url, args)
    results = _verify_store(store, args)
    if not any(result["status"] in _CHECKED for result in results):
        strays = sum(result["status"] == "stray" for result in results)
        note = f" ({strays} stray entries, left alone)" if strays else ""
        raise CheckpointNotFoundError(f"{store.url}: no checkpoints{note}")
    if args.json:
        json.dump({"url": store.url, "results": results}, out, indent=2)
        out.write("\n")
    else:
        _print_verify(results, out)
    return _verify_status(results)


def _verify_store(store: Store, args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.step is not None:
        return [_verify_one(store, args.step, quiet=args.json, named=True)]
    if args.all:
        seen: set[tuple[FileId, int, str]] | None = None
        if store.strategy.saved_incrementally():
            seen = set()  # each stored file shared by checkpoints is read once
        return [
            _verify_one(store, step, quiet=args.json, seen=seen) for step in _listed_steps(store)
        ]
    return _verify_latest(store, quiet=args.json)


def _verify_pair(args: argparse.Namespace, out: TextIO) -> int:
    """Verify each tier's copies: the newest (a STEP, every one with ``--all``) of the fast
    tier and of the durable tier, each read from its own storage. A STEP is an error only
    when neither tier holds it."""
    pair = open_pair(args.url, args.replicate_to, **key_options(args))
    tiers = {"fast": pair.fast, "durable": pair.durable}
    results: list[dict[str, Any]] = []
    missing: list[CheckpointNotFoundError] = []
    try:
        for tier, store in tiers.items():
            if not args.json:
                out.write(f"{tier} tier {printable(store.url)}:\n")
            try:
                found = _verify_store(store, args)
            except CheckpointNotFoundError as exc:  # a named STEP this tier does not hold
                missing.append(exc)
                found = []
                if not args.json:
                    out.write(f"step {args.step}: not in this tier\n")
            results += [{**result, "tier": tier} for result in found]
            if not args.json and found:
                _print_verify(found, out)
    finally:
        pair.close(wait=False)
    if len(missing) == len(tiers):
        raise missing[0]
    if not any(result["status"] in _CHECKED for result in results):
        raise CheckpointNotFoundError(f"{pair.url} -> {pair.durable_url}: no checkpoints")
    if args.json:
        document = {"url": pair.url, "durable_url": pair.durable_url, "results": results}
        json.dump(document, out, indent=2)
        out.write("\n")
    return _verify_status(results)


def _verify_status(results: list[dict[str, Any]]) -> int:
    statuses = {result["status"] for result in results}
    if "broken" in statuses or "untrusted" in statuses:  # a forgery is as bad as damage
        return EXIT_BROKEN
    return EXIT_ERROR if "unreadable" in statuses else EXIT_OK


def _print_verify(results: list[dict[str, Any]], out: TextIO) -> None:
    for result in results:
        step, status = result["step"], result["status"]
        if status == "ok":
            again = result.get("not_read_again", 0)
            shared = f"; {again} shard(s) shared with one checked above" if again else ""
            out.write(f"step {step}: ok ({human_size(result['bytes'])} checked{shared})\n")
        elif status == "broken":
            out.write(f"step {step}: BROKEN\n")
            for problem in result["problems"]:
                out.write(f"  {printable(problem)}\n")
        else:
            entry = {"status": status, "problem": "; ".join(result["problems"])}
            out.write(f"step {step}: {printable(_status_text(entry))}\n")
    counts = {status: sum(r["status"] == status for r in results) for status in _STATUSES}
    summary = f"{counts['ok']} ok, {counts['broken']} broken"
    summary += "".join(f", {counts[s]} {s}" for s in _STATUSES[2:] if counts[s])
    out.write(summary + "\n")


def _verify_latest(store: Store, *, quiet: bool) -> list[dict[str, Any]]:
    """Verify the newest checkpoint; strays and deleted ones on the way are reported too."""
    results = []
    for step in reversed(_listed_steps(store)):
        results.append(_verify_one(store, step, quiet=quiet))
        if results[-1]["status"] in _CHECKED:
            break
    return results


def _verify_one(
    store: Store,
    step: int,
    *,
    quiet: bool,
    named: bool = False,
    seen: set[tuple[FileId, int, str]] | None = None,
) -> dict[str, Any]:
    """Read every shard of ``step`` and check it; ``named``: a STEP the user asked for, whose
    absence is an error rather than a row; ``seen``: the stored files (with the size and
    CRC32C they were checked against) verified whole already in this pass, not read again,
    to which this checkpoint's good ones are added."""
    if named:
        try:
            checkpoint: Checkpoint | None = store.get(step)
        except UntrustedCheckpointError as exc:
            return _verify_result(step, "untrusted", [str(exc)])
        except IntegrityError as exc:
            return _verify_result(step, "broken", [str(exc)])
    else:
        entry, checkpoint = _entry(store, step)
        if checkpoint is None:
            return _verify_result(step, entry["status"], [entry["problem"]])
    assert checkpoint is not None
    keys: dict[str, tuple[FileId, int, str]] = {}
    checked: set[str] = set()
    if seen is not None:
        files = store.strategy.shard_files(checkpoint.manifest)
        records = {record.name: record for record in checkpoint.manifest.shards}
        keys = {  # a file checked against a CRC32C only does not stand for a digest's check
            n: (f, records[n].size, records[n].crc32c + records[n].digest) for n, f in files.items()
        }
        checked = {name for name, key in keys.items() if key in seen}
    bar = ProgressBar(f"step {step}", checkpoint.size, enabled=not quiet)
    try:
        report = checkpoint.verify(progress=bar.advance, checked=checked)
    except CheckpointNotFoundError as exc:  # unpublished by a delete or retention meanwhile
        if named:
            raise
        return _verify_result(step, "vanished", [str(exc)])
    except StorageError as exc:  # a read failed: the bytes were not checked, not found wrong
        if named:
            raise
        return _verify_result(step, "unreadable", [str(exc)])
    finally:
        bar.finish()
    problems = [f"{name}: {problem}" for name, problem in sorted(report.problems.items())]
    result = _verify_result(step, "ok" if report.ok else "broken", problems)
    result["bytes"] = report.bytes_checked
    if seen is not None:
        seen.update(keys[name] for name in keys if name not in report.problems)
        result["not_read_again"] = len(report.not_read_again)
    return result


def _verify_result(step: int, status: str, problems: list[str]) -> dict[str, Any]:
    return {"step": step, "status": status, "problems": problems, "bytes": 0}


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url, args)
    report = store.gc(
        grace=args.grace, superseded_grace=args.superseded_grace, dry_run=args.dry_run
    )
    if args.json:
        json.dump(
            {
                "url": store.url,
                "dry_run": report.dry_run,
                "grace_s": report.grace_s,
                "removed": [vars(item) for item in report.removed],
                "kept_young": [vars(item) for item in report.kept_young],
                "missing_operations": list(report.missing_operations),
                "warnings": list(report.warnings),
            },
            out,
            indent=2,
        )
        out.write("\n")
        return EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    for item in report.removed:  # names are listed from storage: printed escaped
        why = f"{item.why}; " if item.why else ""
        out.write(
            f"{verb} {item.kind} {printable(item.name)} "
            f"({why}idle {_age(item.age_s)}, {human_size(item.size)})\n"
        )
    for item in report.kept_young:
        out.write(
            f"kept {item.kind} {printable(item.name)}: active {_age(item.age_s)} ago (< grace)\n"
        )
    for warning in report.warnings:
        out.write(f"warning: {printable(warning)}\n")
    out.write(
        f"{verb} {len(report.removed)} leftover(s), {human_size(report.removed_bytes)}; "
        f"kept {len(report.kept_young)} younger than {_age(report.grace_s)}\n"
    )
    return EXIT_OK


_AGE_SCALE = ((120, 1, "{:.0f}s"), (3600, 60, "{:.0f}m"), (172800, 3600, "{:.1f}h"))
_DURATION_SCALE = ((120, 1, "{:.1f} s"), (7200, 60, "{:.1f} min"), (172800, 3600, "{:.1f} h"))
"""(below, seconds per unit, format) of each unit, smallest first; days beyond the last."""


def _scaled(seconds: float, scale: tuple[tuple[float, float, str], ...], days: str) -> str:
    """``seconds`` in the first unit of ``scale`` it is below, else in days (``days``)."""
    for below, unit, shown in scale:
        if seconds < below:
            return shown.format(seconds / unit)
    return days.format(seconds / 86400)


def _age(seconds: float) -> str:
    """Seconds, short: ``90s``, ``15m``, ``6.0h``, ``3.0d``."""
    return _scaled(seconds, _AGE_SCALE, "{:.1f}d")


def cmd_delete(args: argparse.Namespace, out: TextIO) -> int:
    if args.replicate_to:
        pair = open_pair(args.url, args.replicate_to, **key_options(args))
        try:
            pair.delete(args.step, force=args.force)
        finally:
            pair.close(wait=False)
        where = f"the pair {pair.url} -> {shown_url(pair.durable_url)}"
        write_result(
            out,
            args.json,
            {"url": pair.url, "durable_url": shown_url(pair.durable_url), "deleted": [args.step]},
            f"deleted step {args.step} from {printable(where)}\n",
        )
        return EXIT_OK
    store = _open(args.url, args)
    store.delete(args.step, force=args.force)
    write_result(
        out,
        args.json,
        {"url": store.url, "deleted": [args.step]},
        f"deleted step {args.step} from {printable(store.url)}\n",
    )
    return EXIT_OK


def cmd_rollback(args: argparse.Namespace, out: TextIO) -> int:
    if args.replicate_to:
        return _rollback_pair(args, out)
    store = _open(args.url, args)
    refuse_a_fast_tier_alone(store, args.step)
    done = store.rollback(args.step)
    after = None if done.collected_after is None else done.collected_after.isoformat()
    if args.json:
        document = {
            "url": store.url,
            "latest": args.step,
            "left_history": done.left,
            "epoch": None if done.epoch is None else done.epoch.number,
            "collected_after": after,
        }
        json.dump(document, out)
        out.write("\n")
        return EXIT_OK
    if done.epoch is None:
        out.write(f"{printable(store.url)}: nothing is newer than step {args.step}\n")
        return EXIT_OK
    left = ", ".join(map(str, done.left))
    out.write(
        f"rolled back {printable(store.url)} to step {args.step} (epoch {done.epoch.number}); "
        f"left the history: {left}\n"
        f"they stay published until gc collects them, from {after or 'unknown'} (default "
        f"--superseded-grace); undo: ckptstore take-over URL {done.left[-1]} --from-epoch "
        f"{done.epoch.base}\n"
    )
    return EXIT_OK


def cmd_take_over(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url, args)
    if args.step is None and not args.discard_history:
        raise InvalidInputError("take-over needs STEP, or --discard-history for a fresh start")
    epoch = store.take_over(
        args.step,
        note=args.note,
        from_epoch=args.from_epoch,
        discard_history=args.discard_history,
    )
    if args.json:
        json.dump({"url": store.url, **epoch_document(epoch)}, out)
        out.write("\n")
        return EXIT_OK
    start = (
        "a fresh start" if epoch.parent is None else f"step {epoch.parent} of epoch {epoch.base}"
    )
    out.write(f"took {printable(store.url)} over from {start}: epoch {epoch.number}\n")
    return EXIT_OK


def _rollback_pair(args: argparse.Namespace, out: TextIO) -> int:
    """One rollback for both tiers of a pair: a takeover of both from the step (§9.3, T6)."""
    pair = open_pair(args.url, args.replicate_to, **key_options(args))
    try:
        left = pair.rollback(args.step)
        document = pair_document(pair, _summary)
    finally:
        pair.close(wait=False)
    if args.json:
        json.dump(
            {
                "url": document["url"],
                "durable_url": document["durable_url"],
                "latest": args.step,
                "left_history": left,
            },
            out,
        )
        out.write("\n")
    else:
        where = f"{printable(document['url'])} -> {printable(document['durable_url'])}"
        listed = ", ".join(map(str, left)) or "nothing"
        out.write(
            f"rolled back the pair {where} to step {args.step}; left the history: {listed} "
            f"(each tier's gc collects them)\n"
        )
    return EXIT_OK


def cmd_conformance(args: argparse.Namespace, out: TextIO) -> int:
    _import_backends(args.imports)
    try:
        from ckptstore.conformance.batch import run_targets
        from ckptstore.conformance.defaults import embedded_targets
        from ckptstore.conformance.report import render_text, to_json, to_junit
        from ckptstore.conformance.runner import Target
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the conformance suite needs {exc.name}: pip install 'ckptstore[conformance]'"
        ) from exc

    def progress(message: str) -> None:
        if not args.json:
            start = "" if message.startswith("conformance: ") else "  .. "
            sys.stderr.write(f"{start}{redact(message)}\n")

    def write(reports: list[Any]) -> None:
        for path, render in ((args.json_file, to_json), (args.junit, to_junit)):
            if path:
                _write_report(path, render(reports))

    def run(targets: list[Target], jobs: int) -> list[Any]:
        # The report files are rewritten after every layer: a run that is stopped leaves the
        # verdicts of the layers that finished.
        return run_targets(
            targets,
            jobs=jobs,
            progress=progress,
            on_layer=write,
            profile=args.profile,
            allow_nonempty=args.yes,
            budget_s=args.budget,
            reproduce=args.reproduce or "",
        )

    if args.reproduce and (len(args.urls) != 1 or args.replicate_to):
        raise InvalidOptionError(
            "--reproduce VERSION:BLOB replays an example on the one URL whose report printed it"
        )
    if args.replicate_to:
        from ckptstore.conformance.runner import run_tiered

        if len(args.urls) != 1:
            raise InvalidOptionError(
                "--replicate-to DURABLE_URL needs exactly one URL: the fast store's"
            )
        reports = [
            run_tiered(args.urls[0], args.replicate_to, progress=progress, on_layer=lambda r: None)
        ]
    elif args.urls:
        reports = run([Target(url) for url in args.urls], args.jobs or 1)
    else:  # as many at once as the machine has cores: a backend keeps about one busy
        with embedded_targets(
            skipped=lambda line: sys.stderr.write(f"conformance: {line}\n")
        ) as targets:
            reports = run(targets, args.jobs or min(len(targets), os.cpu_count() or 1))
    write(reports)
    out.write(to_json(reports) + "\n" if args.json else render_text(reports))
    outcomes = {report.outcome for report in reports}
    if "violated" in outcomes:
        return EXIT_BROKEN
    # Undecided (the storage kept failing) and the suite's own failure are not "broken": no
    # verdict was reached, and the run does not pass either.
    return EXIT_ERROR if outcomes & {"storage error", "suite error"} else EXIT_OK


def _import_backends(modules: Sequence[str]) -> None:
    """Import each module (``--import``), which registers its scheme with
    ``ckptstore.registry.register``: a backend without an installed entry point. Modules are
    found on the Python path, and in the current directory as with ``python -m``."""
    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in modules:
        try:
            registry.import_backend(name)  # remembered: the suite's child processes import it
        except Exception as exc:  # whatever the module raised: its author must see it
            raise InvalidOptionError(
                f"--import {name}: the module could not be imported ({type(exc).__name__}: {exc})"
            ) from exc


def _write_report(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise InvalidOptionError(f"cannot write the report to {path!r}: {exc}") from exc


def cmd_lifecycle(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from ckptstore.backends.s3_open import install_abort_incomplete_uploads_rule
    except ImportError as exc:
        raise BackendUnavailableError("s3:// needs boto3: pip install 'ckptstore[s3]'") from exc
    rule = install_abort_incomplete_uploads_rule(args.url, days=args.days)
    if args.json:
        json.dump(rule, out, indent=2)
        out.write("\n")
    else:
        prefix = rule["Filter"]["Prefix"] or "(the whole bucket)"
        out.write(
            printable(
                f"installed lifecycle rule {rule['ID']}: abort incomplete multipart uploads "
                f"under {prefix} {args.days} day(s) after they start"
            )
            + "\n"
        )
    return EXIT_OK


def cmd_advise(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url, args)
    advice = advise(store, mtbi=args.mtbi, recent=args.recent, restart=args.restart)
    if args.json:
        json.dump({"url": store.url, **advice.to_document()}, out, indent=2)
        out.write("\n")
        return EXIT_OK
    cost, steps = advice.cost, advice.recommended_steps
    kind = (
        "blocked time of asynchronous saves"
        if advice.asynchronous == advice.saves
        else "whole synchronous saves"
        if not advice.asynchronous
        else f"{advice.asynchronous} asynchronous (blocked time), the rest synchronous"
    )
    source = "--mtbi" if advice.mtbi_source == "option" else "the store's restarts, up to now"
    lines = [
        f"checkpoint interval for {store.url}",
        f"  save cost C   median {_duration(cost.median)} (min {_duration(cost.low)}, "
        f"max {_duration(cost.high)}) over {cost.count} saves: {kind}",
        f"  interruptions M every {_duration(advice.mtbi_s)} (from {source}), each "
        f"costing the work since the last save"
        + (f" and a {_duration(advice.restart_s)} restart" if advice.restart_s else ""),
        f"  step rate     {_rate(advice.steps_per_s)} between saves",
        f"  current       {_interval(advice.current_interval_s, advice.current_steps)}",
        f"  recommended   {_interval(advice.recommended_s, steps)} (Daly; Young's "
        f"sqrt(2CM) = {_duration(advice.young_s)})",
    ]
    lines += [f"  left out      {note}" for note in advice.notes]
    out.write("\n".join(map(printable, lines)) + "\n\n")
    rows = [["INTERVAL", "STEPS", "SAVING C/T", "LOST (T/2+R)/M", "TOTAL", ""]]
    for row in advice.table:
        rows.append(
            [
                _duration(row.interval_s),
                "-" if row.steps is None else str(row.steps),
                f"{row.overhead:.2%}",
                f"{row.lost:.2%}",
                f"{row.waste:.2%}",
                row.label,
            ]
        )
    _print_table(rows, out)
    return EXIT_OK


def _duration(seconds: float) -> str:
    """Seconds for a reader: ``850 ms``, ``42.0 s``, ``12.5 min``, ``6.0 h``, ``3.0 d``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return _scaled(seconds, _DURATION_SCALE, "{:.1f} d")


def _rate(steps_per_s: float | None) -> str:
    if steps_per_s is None:
        return "unknown (no training time measured between saves)"
    return f"{steps_per_s:.3g} steps/s"


def _interval(seconds: float | None, steps: int | None) -> str:
    if seconds is None:
        return "unknown"
    return _duration(seconds) + ("" if steps is None else f" of training, {steps} steps")


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    from ckptstore.tools.store_bench import run_bench

    return run_bench(args.url, args.size, args.repeats, out, busy_processes=args.busy)


def cmd_keygen(args: argparse.Namespace, out: TextIO) -> int:
    key = generate_key()
    private, public = write_key_pair(key, args.file)
    write_result(
        out,
        args.json,
        {"key_id": key.key_id, "private": str(private), "public": str(public)},
        f"wrote signing key {key.key_id} to {private} (keep it secret) and its public key "
        f"to {public} (give it to readers: --trust {public})\n",
    )
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from ckptstore.tools.demo import run_demo

    return run_demo(args.dir, out)


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises its errors instead of printing usage and exiting, so bad
    arguments are reported like every other error: one line (and JSON with --json), status 2."""

    def error(self, message: str) -> NoReturn:
        raise InvalidInputError(f"{message} (see {self.prog} --help)")


def _replicate_to(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--replicate-to",
        metavar="DURABLE_URL",
        default=None,
        help=f"URL is the fast tier of a pair with this durable store: {what} (also "
        f"?replicate_to= in URL; docs/tiers.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ckptstore`` command."""
    parser = _Parser(
        prog="ckptstore", description="Crash-safe ML training checkpoints on any storage."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name != "demo":
            p.add_argument("url", metavar="URL", help="store URL (file:///path, a path, ...)")
            p.add_argument("--json", action="store_true", help="print JSON")
        return p

    p = command("ls", "list published checkpoints")
    _replicate_to(p, "list the pair's history")
    add_key_options(p, signs=False)
    p.set_defaults(func=cmd_ls)
    p = command("show", "show a checkpoint's manifest (default: the latest)")
    p.add_argument("step", nargs="?", type=parse_step)
    p.add_argument("--all-shards", action="store_true", help="list every shard")
    _replicate_to(p, "show the pair's checkpoint, from the tier that holds it")
    add_key_options(p, signs=False)
    p.set_defaults(func=cmd_show)
    p = command("verify", "read and check every shard's CRC32C (default: the latest)")
    p.add_argument("step", nargs="?", type=parse_step)
    p.add_argument("--all", action="store_true", help="verify every checkpoint")
    _replicate_to(p, "verify each tier's copies")
    add_key_options(p, signs=False)
    p.set_defaults(func=cmd_verify)
    p = command("gc", "remove leftovers of dead saves idle for longer than the grace period")
    p.add_argument(
        "--grace",
        type=parse_duration,
        default=DEFAULT_GRACE,
        help="idle time before a leftover counts as dead (default 1h; 30s, 15m, 2d...)",
    )
    p.add_argument(
        "--superseded-grace",
        type=parse_duration,
        default=DEFAULT_SUPERSEDED_GRACE,
        help="time after a takeover or rollback before the checkpoints it superseded are "
        "removed; until then it can be undone (default 24h)",
    )
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.set_defaults(func=cmd_gc)
    p = command("delete", "delete one checkpoint (the newest only with --force)")
    p.add_argument("step", type=parse_step)
    p.add_argument("--force", action="store_true", help="allow deleting the newest")
    _replicate_to(p, "delete the step from both tiers")
    p.set_defaults(func=cmd_delete)
    p = command(
        "rollback", "make STEP the newest again: newer checkpoints leave the history (undoable)"
    )
    p.add_argument("step", type=parse_step)
    _replicate_to(p, "roll back the pair")
    add_key_options(p, signs=True)
    p.set_defaults(func=cmd_rollback)
    p = command("take-over", "take the store over from STEP (of --from-epoch: an undo)")
    p.add_argument("step", nargs="?", type=parse_step)
    p.add_argument(
        "--from-epoch",
        type=counted(0, 10**12 - 1),
        default=None,
        help="the epoch of STEP's checkpoint, when a takeover or rollback superseded it",
    )
    p.add_argument("--note", default="", help="free text shown by ls (a job id)")
    add_key_options(p, signs=True)
    p.add_argument(
        "--discard-history",
        action="store_true",
        help="without STEP: a fresh start that supersedes every checkpoint",
    )
    p.set_defaults(func=cmd_take_over)
    p = command("bench", "save and load through ckptstore against the storage's raw baseline")
    p.add_argument(
        "--size", type=parse_size, default="256M", help="bytes to save and load (default 256M)"
    )
    p.add_argument("--repeats", type=counted(1, 1000), default=5, help="(default 5)")
    p.add_argument(
        "--busy",
        type=counted(0, 64),
        default=0,
        metavar="N",
        help="N CPU-bound processes beside the measurement, as on a training node (default 0)",
    )
    p.set_defaults(func=cmd_bench)
    p = command("advise", "the checkpoint interval that loses the least work, from the timings")
    p.add_argument(
        "--mtbi",
        type=parse_positive_duration,
        default=None,
        help="mean time between interruptions (6h, 2d...)",
    )
    p.add_argument(
        "--recent",
        metavar="N",
        type=counted(MIN_SAVES, 100000),
        default=DEFAULT_RECENT,
        help=f"measure the newest N checkpoints (default {DEFAULT_RECENT})",
    )
    p.add_argument(
        "--restart",
        type=parse_duration,
        default=timedelta(0),
        help="time from an interruption to training again, for the table (default 0)",
    )
    p.set_defaults(func=cmd_advise)
    p = command("lifecycle", "install the S3 rule that aborts stale multipart uploads")
    p.add_argument(
        "--days",
        type=counted(1, MAX_DAYS),
        default=7,
        help="days after which to abort (default 7)",
    )
    p.set_defaults(func=cmd_lifecycle)
    p = sub.add_parser(
        "conformance",
        help="prove the invariants on a storage system (default: every built-in backend)",
        description=(
            "Run the conformance suite: capability probes, a crash at every storage call, "
            "power-loss states (file systems), and property-based crash injection. It writes "
            "and deletes under each URL. Exit status 1 if an invariant is violated (or a "
            "declared capability missing); 2 if the storage kept failing (5xx, resets, "
            "timeouts after retries), so that a case was left undecided: a storage error, "
            "not a violation."
        ),
    )
    p.add_argument("urls", nargs="*", metavar="URL", help="store URLs (default: embedded)")
    p.add_argument("--profile", choices=("ci", "thorough"), default="ci")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--json-file", metavar="FILE", type=_output_file, help="also write the report as JSON"
    )
    p.add_argument(
        "--junit", metavar="FILE", type=_output_file, help="also write the report as JUnit XML"
    )
    p.add_argument("--yes", action="store_true", help="run even where the URL is not empty")
    p.add_argument(
        "--replicate-to",
        metavar="DURABLE_URL",
        default=None,
        help="crash a tiered pair (URL fast, DURABLE_URL durable) at every storage call of its "
        "replication, instead of the suite on URL alone (docs/tiers.md)",
    )
    p.add_argument(
        "--budget",
        metavar="SECONDS",
        type=counted(1, 86400),
        default=None,
        help="seconds per backend, shrinking included (default: 60 for ci, none for thorough)",
    )
    p.add_argument(
        "--jobs",
        metavar="N",
        type=counted(1, 64),
        default=None,
        help="backends run at once (default: 1 for URLs given, one per CPU core for the "
        "embedded defaults)",
    )
    p.add_argument(
        "--reproduce",
        metavar="VERSION:BLOB[:STEPS]",
        default=None,
        help="replay one failing example of the property-based layer, as a report printed it "
        "('replay it alone: ...'), and run nothing else",
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first, which registers a scheme (ckptstore.registry.register); "
        "repeatable",
    )
    p.set_defaults(func=cmd_conformance)
    add_directory_commands(sub, parse_step, counted(1, 1024))
    add_repair_command(sub, parse_step, counted(1, 10**12))
    p = sub.add_parser(
        "keygen",
        help="make an Ed25519 key pair for signed checkpoints: FILE (0600) and FILE.pub",
        description="Write a new Ed25519 signing key to FILE (mode 0600, never over an existing "
        "file) and its public key to FILE.pub. Writers sign with --signing-key FILE (or "
        "CKPTSTORE_SIGNING_KEY=FILE, or ckptstore.open(url, signing_key=FILE)); readers trust "
        "FILE.pub (--trust, CKPTSTORE_TRUST, trust=[...]). docs/protocol.md §10.",
    )
    p.add_argument("file", metavar="FILE", help="where to write the private key")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_keygen)
    p = command("demo", "save, crash and resume on an embedded default store (no setup)")
    p.add_argument("--dir", help="directory for the file:// store (default: a temporary one)")
    p.set_defaults(func=cmd_demo)
    return parser


class _EscapingFormatter(logging.Formatter):
    """Warnings quote names read from storage: escaped, one line each, like errors."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(redact(super().format(record)))


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for JSON on stdout, from its words alone: for errors found while
    parsing them, before there is a namespace to ask (argparse accepts unique prefixes)."""
    return any(w == "--json" or (len(w) >= len("--j") and "--json".startswith(w)) for w in argv)


def _report_error(kind: str, message: str, *, as_json: bool, out: TextIO) -> None:
    """One escaped line on stderr; with --json, also ``{"error", "type"}`` on stdout."""
    message = redact(message)
    label = "interrupted" if kind == "KeyboardInterrupt" else f"error: {printable(message)}"
    sys.stderr.write(f"ckptstore: {label}\n")
    if as_json:
        json.dump({"error": message, "type": kind}, out)
        out.write("\n")


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A Python warning (Lustre striping unavailable, ...) as one escaped line, no source."""
    sys.stderr.write(f"ckptstore: warning: {printable(redact(str(message)))}\n")


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line; return the exit status."""
    words = sys.argv[1:] if argv is None else list(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_EscapingFormatter("ckptstore: warning: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    with warnings.catch_warnings():  # restores the caller's warning display on return
        warnings.showwarning = _show_warning
        return _run(words, out or sys.stdout)


def _run(words: list[str], out: TextIO) -> int:
    as_json = _wants_json(words)
    try:
        args = build_parser().parse_args(words)
        as_json = getattr(args, "json", False) is True
        _take_tier_options(args)
        status: int = args.func(args, out)
    except CkptStoreError as exc:
        _report_error(type(exc).__name__, str(exc), as_json=as_json, out=out)
        return EXIT_ERROR
    except KeyboardInterrupt:
        _report_error("KeyboardInterrupt", "interrupted", as_json=as_json, out=out)
        return 130
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_OK
    return status
