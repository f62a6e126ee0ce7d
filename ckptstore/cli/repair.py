"""``ckptstore repair-epoch``: rewrite a damaged epoch record (see ``ckptstore.epoch_repair``
and docs/protocol.md §8.6)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO

from ckptstore.cli.keys import add_key_options, key_options
from ckptstore.cli.output import write_result
from ckptstore.epoch_repair import repair_epoch, resign_epoch
from ckptstore.store import open_store

__all__ = ["add_repair_command"]

EXIT_OK = 0


def cmd_repair_epoch(args: argparse.Namespace, out: TextIO) -> int:
    store = open_store(args.url, create=False, **key_options(args))
    if args.resign:
        signed = resign_epoch(store, args.epoch)
        assert signed.signature is not None
        write_result(
            out,
            args.json,
            {"url": store.url, "epoch": signed.number, "signed_by": signed.signature.key_id},
            f"signed the record of epoch {signed.number} with {signed.signature.key_id}, its "
            f"content unchanged\n",
        )
        return EXIT_OK
    parent = None if args.fresh_start else args.parent
    record = repair_epoch(store, args.epoch, parent, note=args.note)
    resumed = "a fresh start" if record.parent is None else f"step {record.parent}"
    write_result(
        out,
        args.json,
        {"url": store.url, "epoch": record.number, "parent": record.parent},
        f"rewrote the record of epoch {record.number}: resumed from {resumed}\n",
    )
    return EXIT_OK


def add_repair_command(
    sub: Any, parse_step: Callable[[str], int], parse_epoch: Callable[[str], int]
) -> None:
    """Add ``repair-epoch`` to the ``ckptstore`` command's subparsers."""
    text = (
        "rewrite the damaged record of EPOCH (one that does not read back) with the step its "
        "run resumed from; an intact record is never changed"
    )
    p = sub.add_parser("repair-epoch", help=text, description=text)
    p.add_argument("url", metavar="URL", help="store URL (file:///path, s3://bucket/prefix, ...)")
    p.add_argument("epoch", metavar="EPOCH", type=parse_epoch)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--parent", metavar="STEP", type=parse_step,
                       help="the step the run that took EPOCH resumed from")  # fmt: skip
    which.add_argument("--fresh-start", action="store_true",
                       help="the run that took EPOCH started from nothing")  # fmt: skip
    which.add_argument("--resign", action="store_true",
                       help="sign EPOCH's intact record with --signing-key, content unchanged: "
                       "endorse a takeover written without the key (protocol.md §10)")  # fmt: skip
    p.add_argument("--note", default="", help="a note kept in the record (who, why)")
    add_key_options(p, signs=True)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_repair_epoch)
