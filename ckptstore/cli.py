"""The ``ckptstore`` command: ls, show, verify, gc, delete, rollback and demo.

Every command takes a store URL (or a bare path) and ``--json`` for machine-readable output.
Errors print one line, ``ckptstore: error: ...``, and exit with status 2; ``verify`` exits with
status 1 when a checkpoint is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TextIO

from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import (
    BackendUnavailableError,
    CkptStoreError,
    IntegrityError,
    InvalidOptionError,
)
from ckptstore.progress import ProgressBar
from ckptstore.store import DEFAULT_GRACE, Store, open_store

__all__ = ["main"]

EXIT_OK, EXIT_BROKEN, EXIT_ERROR = 0, 1, 2
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """Parse ``90``, ``90s``, ``15m``, ``1h`` or ``2d`` into a timedelta."""
    match = _DURATION_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (examples: 30s, 15m, 1h, 2d)")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def human_size(size: int) -> str:
    """Format a byte count with binary units: ``1.5 GiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _open(url: str) -> Store:
    return open_store(url, create=False)


def _print_table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
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
        "status": "ok",
    }


def cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url)
    entries: list[dict[str, Any]] = []
    for step in store.steps():
        try:
            entries.append(_summary(store.get(step)))
        except IntegrityError as exc:
            entries.append({"step": step, "status": "broken", "problem": str(exc)})
    if args.json:
        json.dump({"url": store.url, "checkpoints": entries}, out, indent=2)
        out.write("\n")
        return EXIT_OK
    if not entries:
        out.write(f"no checkpoints in {store.url}\n")
        return EXIT_OK
    rows = [["STEP", "COMMITTED (UTC)", "SIZE", "SHARDS", "STATUS"]]
    for entry in entries:
        if entry["status"] == "ok":
            rows.append(
                [
                    str(entry["step"]),
                    entry["committed_at"][:19].replace("T", " "),
                    human_size(entry["size"]),
                    str(entry["shards"]),
                    "ok",
                ]
            )
        else:
            rows.append([str(entry["step"]), "-", "-", "-", f"BROKEN: {entry['problem']}"])
    _print_table(rows, out)
    return EXIT_OK


def _pick(store: Store, step: int | None) -> Checkpoint:
    if step is not None:
        return store.get(step)
    latest = store.latest()
    if latest is None:
        raise CkptStoreError(f"{store.url}: no checkpoints")
    return latest


def cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url)
    checkpoint = _pick(store, args.step)
    manifest = checkpoint.manifest
    if args.json:
        json.dump(manifest.to_document(), out, indent=2, sort_keys=True)
        out.write("\n")
        return EXIT_OK
    writer = manifest.writer
    lines = [
        f"checkpoint  step {manifest.step} in {store.url}",
        f"attempt     {manifest.attempt} ({manifest.backend})",
        f"writer      {writer.host} pid {writer.pid}, world size {writer.world_size}",
        f"created     {manifest.created_at.isoformat()}",
        f"committed   {manifest.committed_at.isoformat()}",
        f"size        {human_size(manifest.total_size)} in {len(manifest.shards)} shard(s)",
    ]
    if manifest.timings:
        timing = ", ".join(f"{k} {v:.3f}" for k, v in sorted(manifest.timings.items()))
        lines.append(f"timings     {timing}")
    if manifest.metadata:
        lines.append("metadata    " + json.dumps(dict(manifest.metadata), sort_keys=True)[:2000])
    out.write("\n".join(lines) + "\n\n")
    shown = manifest.shards if args.all_shards else manifest.shards[:50]
    rows = [["SHARD", "SIZE", "CRC32C"]]
    rows += [[s.name, human_size(s.size), s.crc32c] for s in shown]
    _print_table(rows, out)
    if len(shown) < len(manifest.shards):
        out.write(f"... and {len(manifest.shards) - len(shown)} more (--all-shards)\n")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url)
    if args.all:
        steps = store.steps()
    elif args.step is not None:
        steps = [args.step]
    else:
        latest_steps = store.steps()[-1:]
        steps = latest_steps
    if not steps:
        raise CkptStoreError(f"{store.url}: no checkpoints")
    results: list[dict[str, Any]] = []
    for step in steps:
        results.append(_verify_one(store, step, quiet=args.json))
    broken = [r for r in results if r["status"] != "ok"]
    if args.json:
        json.dump({"url": store.url, "results": results}, out, indent=2)
        out.write("\n")
    else:
        for result in results:
            if result["status"] == "ok":
                out.write(f"step {result['step']}: ok ({human_size(result['bytes'])} checked)\n")
            else:
                out.write(f"step {result['step']}: BROKEN\n")
                for problem in result["problems"]:
                    out.write(f"  {problem}\n")
        out.write(f"{len(results) - len(broken)} ok, {len(broken)} broken\n")
    return EXIT_BROKEN if broken else EXIT_OK


def _verify_one(store: Store, step: int, *, quiet: bool) -> dict[str, Any]:
    try:
        checkpoint = store.get(step)
    except IntegrityError as exc:
        return {"step": step, "status": "broken", "problems": [str(exc)], "bytes": 0}
    bar = ProgressBar(f"step {step}", checkpoint.size, enabled=not quiet)
    try:
        report = checkpoint.verify(progress=bar.advance)
    finally:
        bar.finish()
    return {
        "step": step,
        "status": "ok" if report.ok else "broken",
        "problems": [f"{name}: {problem}" for name, problem in sorted(report.problems.items())],
        "bytes": report.bytes_checked,
    }


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url)
    report = store.gc(grace=args.grace, dry_run=args.dry_run)
    if args.json:
        json.dump(
            {
                "url": store.url,
                "dry_run": report.dry_run,
                "grace_s": report.grace_s,
                "removed": [vars(item) for item in report.removed],
                "kept_young": [vars(item) for item in report.kept_young],
            },
            out,
            indent=2,
        )
        out.write("\n")
        return EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    for item in report.removed:
        out.write(
            f"{verb} {item.kind} {item.name} (idle {_age(item.age_s)}, {human_size(item.size)})\n"
        )
    for item in report.kept_young:
        out.write(f"kept {item.kind} {item.name}: active {_age(item.age_s)} ago (< grace)\n")
    out.write(
        f"{verb} {len(report.removed)} leftover(s), {human_size(report.removed_bytes)}; "
        f"kept {len(report.kept_young)} younger than {_age(report.grace_s)}\n"
    )
    return EXIT_OK


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def cmd_delete(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url)
    store.delete(args.step, force=args.force)
    if args.json:
        json.dump({"url": store.url, "deleted": [args.step]}, out)
        out.write("\n")
    else:
        out.write(f"deleted step {args.step} from {store.url}\n")
    return EXIT_OK


def cmd_rollback(args: argparse.Namespace, out: TextIO) -> int:
    store = _open(args.url)
    deleted = store.rollback(args.step)
    if args.json:
        json.dump({"url": store.url, "latest": args.step, "deleted": deleted}, out)
        out.write("\n")
    else:
        listed = ", ".join(map(str, deleted)) or "nothing"
        out.write(f"rolled back {store.url} to step {args.step}; deleted {listed}\n")
    return EXIT_OK


def cmd_conformance(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from ckptstore.conformance.report import render_text, to_json, to_junit
        from ckptstore.conformance.runner import Target, embedded_targets, run_backend
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the conformance suite needs {exc.name}: pip install 'ckptstore[conformance]'"
        ) from exc

    def progress(message: str) -> None:
        if not args.json_stdout:
            sys.stderr.write(f"  .. {message}\n")

    def run(targets: list[Target]) -> list[Any]:
        reports = []
        for target in targets:
            if not args.json_stdout:
                sys.stderr.write(f"conformance: {target.url}\n")
            reports.append(
                run_backend(
                    target.url,
                    options=target.options,
                    profile=args.profile,
                    allow_nonempty=args.yes,
                    progress=progress,
                )
            )
        return reports

    if args.urls:
        reports = run([Target(url) for url in args.urls])
    else:
        with embedded_targets() as targets:
            reports = run(targets)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(to_json(reports))
    if args.junit:
        with open(args.junit, "w", encoding="utf-8") as handle:
            handle.write(to_junit(reports))
    out.write(to_json(reports) + "\n" if args.json_stdout else render_text(reports))
    return EXIT_OK if all(report.ok for report in reports) else EXIT_BROKEN


def cmd_lifecycle(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from ckptstore.backends.s3 import install_abort_incomplete_uploads_rule
    except ImportError as exc:
        raise BackendUnavailableError("s3:// needs boto3: pip install 'ckptstore[s3]'") from exc
    rule = install_abort_incomplete_uploads_rule(args.url, days=args.days)
    if args.json:
        json.dump(rule, out, indent=2)
        out.write("\n")
    else:
        prefix = rule["Filter"]["Prefix"] or "(the whole bucket)"
        out.write(
            f"installed lifecycle rule {rule['ID']}: abort incomplete multipart uploads under "
            f"{prefix} {args.days} day(s) after they start\n"
        )
    return EXIT_OK


def cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    from ckptstore.bench import run_bench
    from ckptstore.benchmarking import sizes

    try:
        size = sizes([args.size])[0]
    except (ValueError, IndexError, KeyError) as exc:
        raise InvalidOptionError(f"--size {args.size!r}: use a size like 256M or 2G") from exc
    return run_bench(args.url, size, args.repeats, out)


def cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    from ckptstore.demo import run_demo

    return run_demo(args.dir, out)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ckptstore`` command."""
    parser = argparse.ArgumentParser(
        prog="ckptstore", description="Crash-safe ML training checkpoints on any storage."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name != "demo":
            p.add_argument("url", metavar="URL", help="store URL (file:///path, a path, ...)")
            p.add_argument("--json", action="store_true", help="print JSON")
        return p

    command("ls", "list published checkpoints").set_defaults(func=cmd_ls)
    p = command("show", "show a checkpoint's manifest (default: the latest)")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--all-shards", action="store_true", help="list every shard")
    p.set_defaults(func=cmd_show)
    p = command("verify", "read and check every shard's CRC32C (default: the latest)")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--all", action="store_true", help="verify every checkpoint")
    p.set_defaults(func=cmd_verify)
    p = command("gc", "remove leftovers of dead saves idle for longer than the grace period")
    p.add_argument(
        "--grace",
        type=parse_duration,
        default=DEFAULT_GRACE,
        help="idle time before a leftover counts as dead (default 1h; 30s, 15m, 2d...)",
    )
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.set_defaults(func=cmd_gc)
    p = command("delete", "delete one checkpoint (the newest only with --force)")
    p.add_argument("step", type=int)
    p.add_argument("--force", action="store_true", help="allow deleting the newest")
    p.set_defaults(func=cmd_delete)
    p = command("rollback", "delete every checkpoint newer than STEP")
    p.add_argument("step", type=int)
    p.set_defaults(func=cmd_rollback)
    p = command("bench", "save and load through ckptstore against the storage's raw baseline")
    p.add_argument("--size", default="256M", help="bytes to save and load (default 256M)")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=cmd_bench)
    p = command("lifecycle", "install the S3 rule that aborts stale multipart uploads")
    p.add_argument("--days", type=int, default=7, help="days after which to abort (default 7)")
    p.set_defaults(func=cmd_lifecycle)
    p = sub.add_parser(
        "conformance",
        help="prove the invariants on a storage system (default: every built-in backend)",
        description=(
            "Run the conformance suite: capability probes, a crash at every storage call, "
            "power-loss states (file systems), and property-based crash injection. It writes "
            "and deletes under each URL. Exit status 1 if an invariant is violated."
        ),
    )
    p.add_argument("urls", nargs="*", metavar="URL", help="store URLs (default: embedded)")
    p.add_argument("--profile", choices=("ci", "thorough"), default="ci")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--junit", metavar="FILE", help="also write the report as JUnit XML")
    p.add_argument("--json-stdout", action="store_true", help="print JSON instead of tables")
    p.add_argument("--yes", action="store_true", help="run even where the URL is not empty")
    p.set_defaults(func=cmd_conformance)
    p = command("demo", "save, crash and resume on an embedded default store (no setup)")
    p.add_argument("--dir", help="directory for the file:// store (default: a temporary one)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="ckptstore: warning: %(message)s")
    try:
        status: int = args.func(args, out or sys.stdout)
    except CkptStoreError as exc:
        sys.stderr.write(f"ckptstore: error: {exc}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("ckptstore: interrupted\n")
        return 130
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_OK
    return status


if __name__ == "__main__":
    sys.exit(main())
