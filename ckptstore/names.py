"""Validated names: steps, shard names and attempt ids that can never escape a store (DESIGN §11).

Every name that reaches a driver passed through one of these checks, both when it is written and
when it is read back from a manifest, so a tampered manifest cannot make a reader open files or
keys outside the store.
"""

from __future__ import annotations

import re
import secrets
import time

from ckptstore.errors import InvalidShardNameError, InvalidStepError

__all__ = [
    "MAX_SEGMENT_BYTES",
    "MAX_SHARD_NAME_BYTES",
    "MAX_STEP",
    "check_attempt_id",
    "check_shard_name",
    "check_step",
    "new_attempt_id",
    "step_token",
]

MAX_STEP = 10**20 - 1
MAX_SHARD_NAME_BYTES = 1024
MAX_SEGMENT_BYTES = 255
_ATTEMPT_RE = re.compile(r"^[0-9a-z]{8,64}$")
_STEP_TOKEN_RE = re.compile(r"^step-(\d{20})$")


def check_step(step: object) -> int:
    """Return ``step`` if it is an int in [0, 10**20); raise InvalidStepError otherwise."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidStepError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0 or step > MAX_STEP:
        raise InvalidStepError(f"step must be in [0, {MAX_STEP}], got {step}")
    return step


def step_token(step: int) -> str:
    """Return the zero-padded name of a step, ``step-<020d>``, which sorts numerically."""
    return f"step-{check_step(step):020d}"


def parse_step_token(token: str) -> int | None:
    """Return the step of an exact ``step-<020d>`` token, or None for any other string."""
    match = _STEP_TOKEN_RE.match(token)
    return int(match.group(1)) if match else None


def check_shard_name(name: object) -> str:
    """Return ``name`` if it is a safe shard name; raise InvalidShardNameError naming the flaw.

    A shard name is relative and '/'-separated, with no empty, ``.`` or ``..`` segment, no
    backslash, no NUL or control character, at most 1024 UTF-8 bytes and 255 bytes a segment.
    """
    if not isinstance(name, str):
        raise InvalidShardNameError(f"shard name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidShardNameError("shard name is empty")
    problem = _shard_name_problem(name)
    if problem:
        raise InvalidShardNameError(f"invalid shard name {name!r}: {problem}")
    return name


def _shard_name_problem(name: str) -> str | None:
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
    if not isinstance(attempt, str) or not _ATTEMPT_RE.match(attempt):
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
