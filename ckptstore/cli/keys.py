"""``--trust`` and ``--signing-key``: the keys a command reads or signs with (ckptstore.signing)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_key_options", "key_options"]


def key_options(args: argparse.Namespace | None) -> dict[str, Any]:
    """The ``--trust`` and ``--signing-key`` a command was given, as ``open`` options (those
    not given are left to $CKPTSTORE_TRUST and $CKPTSTORE_SIGNING_KEY)."""
    options: dict[str, Any] = {}
    if args is not None and getattr(args, "trust", None):
        options["trust"] = list(args.trust)
    if args is not None and getattr(args, "signing_key", None):
        options["signing_key"] = args.signing_key
    return options


def add_key_options(parser: argparse.ArgumentParser, *, signs: bool) -> None:
    """``--trust KEYFILE`` (repeatable) on a command that reads; ``--signing-key`` too on one
    that writes a manifest or an epoch record."""
    parser.add_argument(
        "--trust",
        metavar="KEYFILE",
        action="append",
        default=[],
        help="read only checkpoints signed by this public key (repeatable; default "
        "$CKPTSTORE_TRUST)",
    )
    if signs:
        parser.add_argument(
            "--signing-key",
            metavar="KEYFILE",
            default=None,
            help="sign what this command writes (default $CKPTSTORE_SIGNING_KEY)",
        )
