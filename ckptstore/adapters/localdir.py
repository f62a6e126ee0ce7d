"""The local side of ``materialize``: what ckptstore makes beside a target directory in a
user's file system, and the rule that it replaces nothing it did not make.

Beside a target ``NAME`` ckptstore makes only these, all named ``.NAME.ckptstore-*``:

- ``.NAME.ckptstore-lock``: materializations of one target take turns holding it; each
  removes it when done (still holding it: a waiter that then gets the lock on the removed
  file sees that the name no longer leads to it, and takes the new one).
- ``.NAME.ckptstore-pulled``: the marker. It names the directories a pull made at ``NAME``
  (inode, and a digest of every entry's name, kind and size; not the device number, which a
  network file system may change when it is mounted again); ``replace`` swaps out only a
  directory the marker names and that still holds what the pull wrote. Anything else (the
  user's own directory, the working directory, one an older ckptstore pulled, a symbolic
  link) is refused, and nothing is moved.
- ``.NAME.ckptstore-<12 hex>``: a directory being written, renamed to ``NAME`` when complete.
- ``.NAME.ckptstore-old-<12 hex>``: a pulled directory a replace renamed aside, removed once
  the new one is in place (put back if a crash came between the two renames).
- ``.NAME.ckptstore-pulled-<12 hex>``: a marker being written.

Each is created with ``O_EXCL`` or opened with ``O_NOFOLLOW`` and checked with ``fstat``. An
entry with one of these names that is a symbolic link, or belongs to another user, was not
made by ckptstore: it is an error, never followed, adopted or deleted. Names are compared as
strings, never as patterns.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptstore.errors import InvalidInputError

__all__ = [
    "check_target",
    "fsync_directory",
    "locked",
    "recover",
    "replaceable",
    "staging_path",
    "swap_in",
]

log = logging.getLogger(__name__)

MARKER_FORMAT = "ckptstore-pulled-1"
_MARKER_LIMIT = 64 * 1024
_TOKEN = re.compile(r"[0-9a-f]{12}", re.ASCII)
_RESERVED = re.compile(r"\..*\.ckptstore-.*", re.DOTALL)
_HOW = (
    "replace=True (pull --replace) swaps out only a directory that ckptstore pull made, so "
    "that nothing else is ever deleted"
)


@dataclass(frozen=True)
class Made:
    """A directory as a pull left it: where it is on the file system, and what it holds."""

    inode: int
    tree: str


def _sibling(target: Path, suffix: str) -> Path:
    return target.parent / f".{target.name}.ckptstore-{suffix}"


def staging_path(target: Path) -> Path:
    """A new name for the directory a materialize of ``target`` writes into."""
    return _sibling(target, secrets.token_hex(6))


def check_target(target: Path) -> None:
    """Refuse a target that names no directory entry, or one named like ckptstore's own."""
    if target.name in ("", ".", ".."):
        raise InvalidInputError(
            f"{target}: name the directory to materialise into (not '/', '.' or '..')"
        )
    if _RESERVED.fullmatch(target.name):
        raise InvalidInputError(
            f"{target}: names like .NAME.ckptstore-* are ckptstore's own, beside a pulled "
            f"directory NAME; choose another name"
        )


def _planted(path: Path, why: str) -> InvalidInputError:
    return InvalidInputError(
        f"{path} {why}, so ckptstore did not make it and will not follow, adopt or delete it: "
        f"remove it, then retry (or materialise into another directory)"
    )


def _open_ours(path: Path, flags: int, what: str) -> int:
    """Open ``path`` (never through a symbolic link) and check it is a regular file of ours."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise _planted(path, "is a symbolic link") from exc
        raise
    try:
        _check_ours(path, os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_ours(path: Path, info: os.stat_result, what: str) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise _planted(path, "is a symbolic link")
    if what == "file" and not stat.S_ISREG(info.st_mode):
        raise _planted(path, "is not a regular file")
    if what == "directory" and not stat.S_ISDIR(info.st_mode):
        raise _planted(path, "is not a directory")
    if info.st_uid != os.geteuid():
        raise _planted(path, f"belongs to another user (uid {info.st_uid})")


# -- the lock ------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(target: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``target`` (``.NAME.ckptstore-lock`` beside it) for one
    materialize at a time, and remove the lock file when done."""
    path = _sibling(target, "lock")
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _leads_to(path, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder removed it while we waited: lock the one there now
    try:
        yield
    finally:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # still holding it: a waiter on this file sees it gone
        finally:
            os.close(fd)  # releases the lock


def _open_lock(path: Path) -> int:
    while True:
        try:
            return _open_ours(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, "file")
        except FileExistsError:
            pass  # another's, or left by an older ckptstore: take turns on it
        try:
            return _open_ours(path, os.O_RDWR, "file")
        except FileNotFoundError:
            continue  # removed in between by the one that held it


def _leads_to(path: Path, fd: int) -> bool:
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


# -- the marker ----------------------------------------------------------------------------


def made(directory: Path) -> Made | None:
    """``directory`` as a pull would have left it, or None if it is not a directory of ours
    holding only directories and regular files."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        return None
    entries: list[tuple[str, str, int]] = []
    for folder, subfolders, files in os.walk(directory, onerror=_raise):
        here = Path(folder)
        for name in [*subfolders, *files]:
            entry = os.lstat(here / name)
            relative = (here / name).relative_to(directory).as_posix()
            if stat.S_ISDIR(entry.st_mode):
                entries.append(("d", relative, 0))
            elif stat.S_ISREG(entry.st_mode):
                entries.append(("f", relative, entry.st_size))
            else:
                return None  # a link, a socket, ...: a pull makes none
    tree = hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()
    return Made(info.st_ino, tree)


def _raise(error: OSError) -> None:
    raise error


def _marked(target: Path) -> list[Made]:
    """The directories the marker of ``target`` names (none if it is missing or damaged)."""
    path = _sibling(target, "pulled")
    try:
        fd = _open_ours(path, os.O_RDONLY, "file")
    except FileNotFoundError:
        return []
    with os.fdopen(fd, "rb") as stream:
        data = stream.read(_MARKER_LIMIT + 1)
    try:
        if len(data) > _MARKER_LIMIT:
            raise ValueError("too long")
        record = json.loads(data)
        if not isinstance(record, dict) or record.get("format") != MARKER_FORMAT:
            raise ValueError("not a marker")
        found = []
        for entry in record["directories"]:
            inode, tree = entry["inode"], entry["tree"]
            if type(inode) is not int or not isinstance(tree, str):
                raise ValueError("not a directory")
            found.append(Made(inode, tree))
    except (ValueError, RecursionError, KeyError, TypeError):
        log.warning("%s: not a ckptstore marker; it names no pulled directory", path)
        return []
    return found


def _mark(target: Path, directories: list[Made]) -> None:
    """Write the marker of ``target`` naming ``directories``, atomically."""
    record = {
        "format": MARKER_FORMAT,
        "about": f"written by ckptstore pull: the directories named here were made at "
        f"{target.name} by a pull, and a pull may replace them",
        "directories": [vars(d) for d in directories],
    }
    temporary = _sibling(target, f"pulled-{secrets.token_hex(6)}")
    try:
        fd = _open_ours(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "file")
        with os.fdopen(fd, "wb") as stream:
            stream.write(json.dumps(record).encode())
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, _sibling(target, "pulled"))  # replaces a link, never follows it
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def replaceable(target: Path) -> Made:
    """What is at ``target``, if it is a directory a pull made and left as it was; else
    InvalidInputError saying why it is not replaced and how to proceed."""
    info = os.lstat(target)
    if stat.S_ISLNK(info.st_mode):
        raise InvalidInputError(
            f"{target} is a symbolic link: {_HOW}; remove the link yourself, or pull into "
            f"another directory"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidInputError(
            f"{target} is not a directory: {_HOW}; move it away yourself, or pull into "
            f"another directory"
        )
    now = made(target)
    marked = _marked(target)
    if now is not None and now in marked:
        return now
    if any(m.inode == info.st_ino for m in marked):
        raise InvalidInputError(
            f"{target} was made by ckptstore pull but has changed since (entries added, "
            f"removed or resized): {_HOW} as it left it; move it away or remove it yourself, "
            f"or pull into another directory"
        )
    raise InvalidInputError(
        f"{target} was not made by ckptstore pull (no marker .{target.name}.ckptstore-pulled "
        f"beside it names it; an older ckptstore wrote none): {_HOW}; move it away or remove "
        f"it yourself, or pull into another directory"
    )


# -- the swap and its recovery -------------------------------------------------------------


def swap_in(staging: Path, target: Path, old: Made | None) -> None:
    """Rename the complete, synced ``staging`` to ``target``. ``old`` is what ``replaceable``
    found at ``target`` (None: nothing there): renamed aside first, removed once the new one
    is in place. The marker names both until the swap is done, the new one after."""
    new = made(staging)
    if new is None:
        raise _planted(staging, "holds entries a pull does not make")
    _mark(target, [d for d in (old, new) if d is not None])
    aside = None
    if old is not None:
        if made(target) != old:  # written to while the checkpoint was: theirs now
            raise InvalidInputError(
                f"{target} changed while the checkpoint was being written (entries added, "
                f"removed or resized): nothing was replaced; {_HOW} as it left it"
            )
        aside = _sibling(target, f"old-{secrets.token_hex(6)}")
        os.rename(target, aside)
        moved = os.lstat(aside)
        if moved.st_ino != old.inode:
            os.rename(aside, target)  # replaced since it was checked: put it back, untouched
            raise InvalidInputError(f"{target} changed while it was being replaced: retry")
    try:
        os.rename(staging, target)
    except OSError:
        if aside is not None:
            os.rename(aside, target)  # put it back
        raise
    fsync_directory(target.parent)
    if aside is not None:
        _remove(aside)
    _mark(target, [new])


def recover(target: Path) -> None:
    """Finish what an interrupted materialize of ``target`` left (under the lock): a pulled
    directory it had renamed aside goes back if nothing took its place, and its temporaries
    go. Only entries ckptstore made are touched: see the module's docstring."""
    prefix = f".{target.name}.ckptstore-"
    staging, aside, temporaries = [], [], []
    with os.scandir(target.parent) as entries:
        for entry in entries:
            if not entry.name.startswith(prefix):
                continue
            rest = entry.name[len(prefix) :]
            if _TOKEN.fullmatch(rest):
                staging.append(Path(entry.path))
            elif rest.startswith("old-") and _TOKEN.fullmatch(rest[4:]):
                aside.append(Path(entry.path))
            elif rest.startswith("pulled-") and _TOKEN.fullmatch(rest[7:]):
                temporaries.append(Path(entry.path))
    if not (staging or aside or temporaries):
        return
    for path in staging:
        _check_ours(path, os.lstat(path), "directory")
    for path in aside:
        _check_ours(path, os.lstat(path), "any")
    for path in temporaries:
        _check_ours(path, os.lstat(path), "file")
    marked = _marked(target)
    ours = [p for p in aside if _renamed_from(p, marked)]
    for path in aside:
        if path not in ours:
            log.warning(
                "%s: named like a directory ckptstore renamed aside, but no marker names it; "
                "left in place: move it away or remove it yourself",
                path,
            )
    if ours and not _exists(target):  # the crash came between the two renames: put it back
        newest = max(ours, key=lambda p: os.lstat(p).st_ctime_ns)
        os.rename(newest, target)
        ours.remove(newest)
    for path in [*staging, *ours, *temporaries]:
        _remove(path)


def _renamed_from(path: Path, marked: list[Made]) -> bool:
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and any(m.inode == info.st_ino for m in marked)


def _exists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)  # never follows a link inside
        else:
            path.unlink()


def fsync_directory(path: Path) -> None:
    """Make a directory's entries durable (fsync of the directory itself)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
