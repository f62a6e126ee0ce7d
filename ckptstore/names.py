"""Validated names: steps, shard names and attempt ids that can never escape a store.

The rules: docs/protocol.md §1.

Every name that reaches a driver passed through one of these checks, both when it is written and
when it is read back from a manifest, so a tampered manifest cannot make a reader open files or
keys outside the store.
"""

from __future__ import annotations

import re
import secrets
import time
import unicodedata

from ckptstore.errors import InvalidShardNameError, InvalidStepError

__all__ = [
    "MAX_EPOCH",
    "MAX_SEGMENT_BYTES",
    "MAX_SHARD_NAME_BYTES",
    "MAX_STEP",
    "check_attempt_id",
    "check_epoch",
    "check_shard_name",
    "check_step",
    "checkpoint_token",
    "epoch_token",
    "new_attempt_id",
    "parse_attempt_name",
    "parse_checkpoint_token",
    "parse_epoch_token",
    "parse_step_token",
    "step_token",
]

MAX_STEP = 10**20 - 1
MAX_EPOCH = 10**20 - 1
MAX_SHARD_NAME_BYTES = 1024
MAX_SEGMENT_BYTES = 255
# ASCII classes and fullmatch only: ``\d`` matches any Unicode digit (Arabic-Indic, ...) and
# ``$`` matches before a trailing newline, so a stray entry named like a step or an attempt id
# would otherwise parse as one.
_ATTEMPT_RE = re.compile(r"[0-9a-z]{8,64}", re.ASCII)
_STEP_TOKEN_RE = re.compile(r"step-([0-9]{20})", re.ASCII)
_CHECKPOINT_TOKEN_RE = re.compile(r"step-([0-9]{20})(?:\.epoch-([0-9]{20}))?", re.ASCII)
_EPOCH_TOKEN_RE = re.compile(r"epoch-([0-9]{20})", re.ASCII)


def _check_number(what: str, number: object, most: int) -> int:
    """Return ``number`` if it is an int in [0, ``most``]; raise InvalidStepError, naming it
    ``what``, otherwise."""
    if isinstance(number, bool) or not isinstance(number, int):
        raise InvalidStepError(f"{what} must be an int, got {type(number).__name__} {number!r}")
    if number < 0 or number > most:
        raise InvalidStepError(f"{what} must be in [0, {most}], got {number}")
    return number


def check_step(step: object) -> int:
    """Return ``step`` if it is an int in [0, 10**20); raise InvalidStepError otherwise."""
    return _check_number("step", step, MAX_STEP)


def step_token(step: int) -> str:
    """Return the zero-padded name of a step, ``step-<020d>``, which sorts numerically."""
    return f"step-{check_step(step):020d}"


def parse_step_token(token: str) -> int | None:
    """Return the step of an exact ``step-<020d>`` token, or None for any other string."""
    match = _STEP_TOKEN_RE.fullmatch(token)
    return int(match.group(1)) if match else None


def check_epoch(epoch: object) -> int:
    """Return ``epoch`` if it is an int in [0, 10**20); raise InvalidStepError otherwise."""
    return _check_number("epoch", epoch, MAX_EPOCH)


def epoch_token(epoch: int) -> str:
    """Return the zero-padded name of an epoch record, ``epoch-<020d>``."""
    return f"epoch-{check_epoch(epoch):020d}"


def parse_epoch_token(token: str) -> int | None:
    """Return the epoch of an exact ``epoch-<020d>`` token, or None for any other string."""
    match = _EPOCH_TOKEN_RE.fullmatch(token)
    return int(match.group(1)) if match else None


def checkpoint_token(step: int, epoch: int = 0) -> str:
    """Return the name of the commit point of ``step`` in ``epoch`` (docs/protocol.md §8.1).

    Epoch 0 keeps the name every store had before lineages, ``step-<020d>``; a later epoch's
    name carries it, ``step-<020d>.epoch-<020d>``, so that two histories never clash.
    """
    if check_epoch(epoch) == 0:
        return step_token(step)
    return f"{step_token(step)}.{epoch_token(epoch)}"


def parse_checkpoint_token(token: str) -> tuple[int, int] | None:
    """Return (step, epoch) of an exact commit-point name (``checkpoint_token``), or None."""
    match = _CHECKPOINT_TOKEN_RE.fullmatch(token)
    if match is None:
        return None
    epoch = int(match.group(2)) if match.group(2) is not None else 0
    if match.group(2) is not None and epoch == 0:
        return None  # epoch 0 has only the plain name: another spelling is not the protocol's
    return int(match.group(1)), epoch


def parse_attempt_name(name: str, separator: str) -> tuple[int, str] | None:
    """Return (step, attempt) of an exact ``step-<020d><separator><attempt id>`` name, or None.

    Cleanup uses it to recognise what the protocol made: anything else is left alone.
    """
    token, found, attempt = name.partition(separator)
    step = parse_step_token(token) if found else None
    if step is None or not _ATTEMPT_RE.fullmatch(attempt):
        return None
    return step, attempt


def check_shard_name(name: object, *, stored: bool = False) -> str:
    """Return ``name`` if it is a safe shard name; raise InvalidShardNameError naming the flaw.

    A shard name is relative and '/'-separated, with no empty, ``.`` or ``..`` segment, no
    backslash, no control, format (bidi, zero-width) or line/paragraph separator character, at
    most 1024 UTF-8 bytes and 255 bytes a segment. ``stored=True`` (a name read back from a
    manifest) keeps only the rules every version enforced at write time, so a checkpoint saved
    before a display-only rule was added stays readable; such names are printed escaped.
    """
    if not isinstance(name, str):
        raise InvalidShardNameError(f"shard name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidShardNameError("shard name is empty")
    problem = _shard_name_problem(name, stored=stored)
    if problem:
        raise InvalidShardNameError(f"invalid shard name {name!r}: {problem}")
    return name


# Control (C0, DEL, C1 such as NEL U+0085), format (bidi overrides U+202E, zero-width joiners)
# and line/paragraph separators (U+2028/9): a name holding one can end or reorder a line of a
# listing, so what an operator reads is not what is stored.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _shard_name_problem(name: str, *, stored: bool = False) -> str | None:
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8 (lone surrogate)"
    if len(encoded) > MAX_SHARD_NAME_BYTES:
        return f"longer than {MAX_SHARD_NAME_BYTES} bytes"
    if name.startswith("/"):
        return "absolute (leading '/')"
    if "\\" in name:
        return "contains a backslash"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        return "contains a NUL or control character"
    if not stored and any(unicodedata.category(ch) in _UNSAFE_CATEGORIES for ch in name):
        return "contains a control, format (bidi, zero-width) or line separator character"
    for segment in name.split("/"):
        if segment == "":
            return "empty path segment ('//' or trailing '/')"
        if segment in (".", ".."):
            return f"'{segment}' path segment"
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            return f"path segment longer than {MAX_SEGMENT_BYTES} bytes"
    return None


def new_attempt_id() -> str:
    """Return a fresh attempt id: base-36 milliseconds since the epoch, then 64 random bits."""
    millis = int(time.time() * 1000)
    return f"{_base36(millis)}{secrets.token_hex(8)}"


def check_attempt_id(attempt: object) -> str:
    """Return ``attempt`` if it is 8 to 64 lowercase letters and digits; raise ValueError."""
    if not isinstance(attempt, str) or not _ATTEMPT_RE.fullmatch(attempt):
        raise InvalidShardNameError(f"invalid attempt id {attempt!r}")
    return attempt


def _base36(value: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        value, rem = divmod(value, 36)
        out = digits[rem] + out
        if value == 0:
            return out
