"""``ckptstore push`` and ``ckptstore pull``: a trainer's checkpoint directory published as one
checkpoint, and a checkpoint materialised into a local directory (see ``ckptstore.directory``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO

from ckptstore.adapters.directory import (
    DEFAULT_PARALLEL,
    materialize,
    publish_directory,
    refuse_nested,
)
from ckptstore.cli.keys import add_key_options, key_options
from ckptstore.cli.output import write_result
from ckptstore.errors import CheckpointNotFoundError, InvalidInputError, InvalidOptionError
from ckptstore.interface import CheckpointStore
from ckptstore.store import open_store
from ckptstore.tiers.tiered import TieredStore, open_checkpoints, split_tiered_url

__all__ = ["add_directory_commands"]

EXIT_OK = 0


def cmd_push(args: argparse.Namespace, out: TextIO) -> int:
    """Publish DIR; to a tiered URL (``?replicate_to=``), in the fast tier, and the command
    ends once the durable tier holds it too."""
    refuse_nested(args.url, args.directory)  # before the store's root is created in it
    if split_tiered_url(args.url)[1]:
        if args.epoch is not None:
            raise InvalidOptionError(
                "push --epoch names an epoch of one store; a tiered pair's epochs are its "
                "takeover's: push to the pair without --epoch, or to one tier"
            )
        store: CheckpointStore = open_checkpoints(args.url, **key_options(args))
    else:
        store = open_store(args.url, epoch=args.epoch, **key_options(args))
    with store:
        checkpoint = publish_directory(
            store,
            args.step,
            args.directory,
            parallel=args.parallel,
            follow_symlinks=args.follow_symlinks,
            clone=True,
        )
    write_result(
        out,
        args.json,
        {
            "url": store.url,
            "step": checkpoint.step,
            "files": len(checkpoint.names),
            "bytes": checkpoint.size,
        },
        f"published step {checkpoint.step} to {store.url}: {len(checkpoint.names)} files, "
        f"{checkpoint.size} bytes\n",
    )
    return EXIT_OK


def cmd_pull(args: argparse.Namespace, out: TextIO) -> int:
    if args.step is None and args.directory.isdigit():
        raise InvalidInputError(
            f"pull: {args.directory!r} looks like a step, but it is the only argument after "
            f"the URL, so it would be the directory: give both (pull URL {args.directory} DIR), "
            f"or ./{args.directory} for a directory of that name"
        )
    store: CheckpointStore = (
        open_checkpoints(args.url, create=False, background=False, **key_options(args))
        if split_tiered_url(args.url)[1]  # reads; never copies
        else open_store(args.url, create=False, **key_options(args))
    )
    try:
        checkpoint = store.latest() if args.step is None else store.get(args.step)
        if checkpoint is None:
            raise CheckpointNotFoundError(f"{store.url}: no checkpoints")
        target = materialize(
            checkpoint, args.directory, replace=args.replace, parallel=args.parallel
        )
    finally:
        if isinstance(store, TieredStore):
            store.close(wait=False)
        else:
            store.close()
    write_result(
        out,
        args.json,
        {
            "url": store.url,
            "step": checkpoint.step,
            "directory": str(target),
            "files": len(checkpoint.names),
        },
        f"materialised step {checkpoint.step} of {store.url} into {target}\n",
    )
    return EXIT_OK


def add_directory_commands(
    sub: Any, parse_step: Callable[[str], int], parse_count: Callable[[str], int]
) -> None:
    """Add ``push`` and ``pull`` to the ``ckptstore`` command's subparsers."""
    text = "publish a checkpoint directory (every file under DIR) as checkpoint STEP, atomically"
    p = sub.add_parser("push", help=text, description=text)
    p.add_argument("directory", metavar="DIR")
    p.add_argument("url", metavar="URL", help="store URL (file:///path, s3://bucket/prefix, ...)")
    p.add_argument("--step", type=parse_step, required=True)
    p.add_argument("--parallel", type=parse_count, default=DEFAULT_PARALLEL,
                   help=f"files streamed at once (default {DEFAULT_PARALLEL})")  # fmt: skip
    p.add_argument(
        "--epoch",
        type=parse_step,
        default=None,
        help="the epoch to publish in (the run's, once the store was taken over; also "
        "?epoch=N in the URL)",
    )
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="publish what symbolic links to files point to (default: refuse links)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    add_key_options(p, signs=True)
    p.set_defaults(func=cmd_push, takes_tiered_url=True)
    text = (
        "write checkpoint STEP (default: the latest) into DIR, verified; DIR appears whole or "
        "not at all"
    )
    p = sub.add_parser("pull", help=text, description=text)
    p.add_argument("url", metavar="URL", help="store URL")
    p.add_argument("step", metavar="STEP", nargs="?", type=parse_step)
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--replace", action="store_true",
                   help="swap out DIR if a pull made it (anything else is refused)")  # fmt: skip
    p.add_argument("--parallel", type=parse_count, default=DEFAULT_PARALLEL,
                   help=f"files written at once (default {DEFAULT_PARALLEL})")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")
    add_key_options(p, signs=False)
    p.set_defaults(func=cmd_pull, takes_tiered_url=True)
