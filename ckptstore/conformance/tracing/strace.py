"""Recording system calls with strace: run a command under it and parse what the kernel saw.

strace, not an LD_PRELOAD shim: it sees the raw system calls, whatever made them (a libc
wrapper, ``syscall(2)`` through ctypes, a statically linked helper), so a driver that calls
``rename(2)`` where it should call ``renameat2(RENAME_NOREPLACE)`` cannot hide it behind a
wrapper a shim does not interpose. The cost is ptrace's: with ``--seccomp-bpf`` only the
traced calls stop the process, which keeps a traced workload within a second or so.

Every byte string is recorded in hex (``-xx``), so a path or a written buffer decodes exactly.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "TRACED_CALLS",
    "Syscall",
    "TracerUnavailable",
    "decode_string",
    "parse_trace",
    "split_args",
    "trace_command",
]

TRACED_CALLS = (
    "open", "openat", "openat2", "creat", "close", "dup", "dup2", "dup3", "fcntl",
    "write", "pwrite64", "writev", "pwritev", "pwritev2",
    "fsync", "fdatasync", "sync_file_range", "syncfs", "sync",
    "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat",
    "mkdir", "mkdirat", "unlink", "unlinkat", "rmdir",
    "truncate", "ftruncate", "fallocate", "chdir", "fchdir",
)  # fmt: skip
"""Calls that open, duplicate or close descriptors, change files or directories, or make
them durable (the ``?`` strace is given before each skips a name this architecture lacks)."""
STRING_LIMIT = 4 * 1024 * 1024
"""Bytes of a buffer strace prints; a longer write cannot be replayed (and is reported so)."""


class TracerUnavailable(Exception):
    """strace is missing or cannot trace here (no ptrace); the message says why."""


@dataclass(frozen=True)
class Syscall:
    """One completed system call as strace printed it."""

    number: int
    """Its position in the trace (0-based, in order of completion)."""
    tid: int
    name: str
    args: tuple[str, ...]
    result: int | None
    """The return value; None where strace printed none (``?``)."""
    error: str | None = None
    """``ENOENT`` and the like when the call failed."""

    @property
    def ok(self) -> bool:
        """The call succeeded."""
        return self.error is None and self.result is not None and self.result >= 0

    def __str__(self) -> str:
        args = ", ".join(_shown(a) for a in self.args)
        outcome = f"-1 {self.error}" if self.error else str(self.result)
        return f"{self.name}({args}) = {outcome}"


def trace_command(
    argv: Sequence[str], output: str, *, cwd: str, env: Mapping[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` under strace, following its threads, writing the trace to ``output``.

    Raises TracerUnavailable when strace is not installed or could not start tracing.
    """
    strace = shutil.which("strace")
    if strace is None:
        raise TracerUnavailable("strace is not installed (apt-get install strace)")
    command = [
        strace, "-f", "--seccomp-bpf", "-qq", "-xx", f"-s{STRING_LIMIT}", "-e", "signal=none",
        "-e", "trace=" + ",".join(f"?{name}" for name in TRACED_CALLS), "-o", output, "--",
        *argv,
    ]  # fmt: skip
    completed = subprocess.run(
        command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout_s
    )
    if not os.path.exists(output) or os.path.getsize(output) == 0:
        first = (completed.stderr.strip().splitlines() or ["no trace written"])[0]
        raise TracerUnavailable(f"strace could not trace here: {first}")
    return completed


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^([a-z0-9_]+)\((.*)$")
_RESUMED = re.compile(r"^<\.\.\. ([a-z0-9_]+) resumed>(.*)$")
_RESULT = re.compile(r"\)\s+=\s+(-?\d+|0x[0-9a-f]+|\?)(?:\s+([A-Z][A-Z0-9_]+))?[^=]*$")


def parse_trace(text: str) -> list[Syscall]:
    """The completed calls of an ``strace -f -xx`` trace, in order of completion.

    A call interrupted by another thread's (``<unfinished ...>``) is joined with its
    ``<... resumed>`` half and placed where it completed: that is when it took effect.
    """
    pending: dict[int, str] = {}
    calls: list[Syscall] = []
    for raw in text.splitlines():
        line = _LINE.match(raw)
        if line is None:
            continue
        tid, rest = int(line.group(1)), line.group(2)
        if rest.endswith("<unfinished ...>"):
            pending[tid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = _RESUMED.match(rest)
        if resumed is not None:
            rest = pending.pop(tid, f"{resumed.group(1)}(") + resumed.group(2)
        call = _parse_call(len(calls), tid, rest)
        if call is not None:
            calls.append(call)
    return calls


def _parse_call(number: int, tid: int, text: str) -> Syscall | None:
    call = _CALL.match(text)
    result = _RESULT.search(text)
    if call is None or result is None:
        return None
    value = result.group(1)
    code = None if value == "?" else int(value, 0)
    body = text[len(call.group(1)) + 1 : result.start()]
    error = result.group(2) if code is not None and code < 0 else None
    return Syscall(number, tid, call.group(1), split_args(body), code, error)


def split_args(body: str) -> tuple[str, ...]:
    """Split strace's argument list at the commas outside strings, braces and brackets."""
    args: list[str] = []
    depth = 0
    quoted = False
    start = 0
    index = 0
    while index < len(body):
        char = body[index]
        if quoted:
            if char == "\\":
                index += 1
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char in "{[(":
            depth += 1
        elif char in "}])":
            depth -= 1
        elif char == "," and depth == 0:
            args.append(body[start:index].strip())
            start = index + 1
        index += 1
    tail = body[start:].strip()
    if tail or args:
        args.append(tail)
    return tuple(args)


_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|[0-7]{1,3}|.)")
_SIMPLE = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"v": b"\v", b"f": b"\f"}


def decode_string(arg: str) -> tuple[bytes, bool] | None:
    """The bytes of a quoted strace string, and whether strace cut it short; None if the
    argument is not a string (NULL, a number)."""
    if not arg.startswith('"'):
        return None
    truncated = arg.endswith("...")
    inner = arg[1 : (-4 if truncated else -1)]

    def unescape(match: re.Match[bytes]) -> bytes:
        code = match.group(1)
        if code[:1] == b"x":
            return bytes([int(code[1:], 16)])
        if code[:1].isdigit():
            return bytes([int(code, 8)])
        return _SIMPLE.get(code, code)

    return _ESCAPE.sub(unescape, inner.encode("latin-1")), truncated


def _shown(arg: str) -> str:
    decoded = decode_string(arg)
    if decoded is None:
        return arg
    data, truncated = decoded
    if data.isascii() and data.decode().isprintable() and len(data) <= 240:
        return repr(data.decode()).replace("'", '"')
    return f"<{len(data)}{'+' if truncated else ''} bytes>"
