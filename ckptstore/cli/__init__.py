"""The ``ckptstore`` command: ls, show, verify, gc, delete, rollback, take-over, push, pull,
bench, advise, lifecycle, repair-epoch, conformance and demo (``commands``), one module per
group of commands (``directory``, ``lineage``, ``repair``, ``tiers``) and the progress bar."""

from ckptstore.cli.commands import build_parser, main, parse_duration

__all__ = ["build_parser", "main", "parse_duration"]
