"""Foreign entries in a store: what operators and broken copies leave, planted and watched.

A store is shared with people and tools. An operator's ``mkdir step-…``, a file named like a
step, an interrupted ``cp -r`` or ``aws s3 sync`` of a checkpoint without its manifest, a
directory or a FIFO (on object stores a "directory marker" key, or keys under a manifest's
name) where a manifest or the LATEST pointer belongs, a corrupt pointer: the protocol must
never take one for a checkpoint, never block on one, and never delete one (docs/protocol.md
§5.2; I1, I7). ``plant`` writes such an entry through the raw driver, behind the store's back,
and returns a ``Stray`` that ``disturbed`` checks afterwards.

Each entry is named like a step the suite never saves (a step it skips, or the largest step
there is), so an entry taken for a checkpoint is always a phantom the model can name. Names
that an old, lenient parser read as a step are among them: digits that are not ASCII
(Arabic-Indic), a trailing newline.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_module
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ckptstore.driver import DriverFamily, driver_family
from ckptstore.errors import CkptStoreError, ObjectNotFoundError
from ckptstore.names import MAX_STEP, step_token

__all__ = [
    "FILE_SYSTEM_KINDS",
    "OBJECT_STORE_KINDS",
    "POINTER_KINDS",
    "FifoGuard",
    "Stray",
    "disturbed",
    "fifo_paths",
    "plant",
    "plant_pointer",
]

FILE_SYSTEM_KINDS = (
    "empty directory",
    "file",
    "partial copy",
    "non-ASCII digits",
    "trailing newline",
    "manifest is a directory",
    "manifest is a FIFO",
    "staging-like copy",
    "trash-like directory",
)
OBJECT_STORE_KINDS = (
    "file",
    "directory marker",
    "partial copy",
    "non-ASCII digits",
    "trailing newline",
    "manifest is a directory marker",
    "key under a manifest",
)
POINTER_KINDS = (
    b"garbage",
    b"",
    b"\xff\xfe7",
    b"-1\n",
    b"1_0\n",
    b" 7\n",
    b"\xd9\xa1\xd9\xa2\n",  # Arabic-Indic "12": int() would read it
    b"100000000000000000000\n",  # past the largest step
    "largest step",
    "never published",
    "directory",
    "FIFO",
)
_ARABIC_INDIC = str.maketrans(
    "0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669"
)
_LATEST = "LATEST"
_MANIFESTS = "manifests/"


@dataclass
class Stray:
    """One foreign entry planted in a store, and how to tell it is still there as planted."""

    what: str
    """What it is, for a report: ``an empty directory named like step 7``."""
    step: int | None
    """The step it is named like (None: it mimics something else, say a leftover)."""
    entries: dict[str, str] = field(default_factory=dict)
    """Each raw name planted (relative to the store) and its kind: ``dir``, ``fifo``, or the
    bytes' length for a file or object."""
    damaged: bool = False
    """Its manifest is present but unreadable: damage by design, not a mere stray."""
    must_stay: bool = True
    """False for a pointer: LATEST is the protocol's name, and a publish may rewrite it."""

    def owns(self, raw_name: str) -> bool:
        """Whether a name from a raw listing (``key@version`` on versioned stores) is part of
        this stray."""
        for name in self.entries:
            base = name.rstrip("/")
            if raw_name in (name, base) or raw_name.startswith((f"{name}@", f"{base}/")):
                return True
        return False


def plant(
    location: Any, kind: str, step: int, copy_of: dict[str, bytes] | None = None
) -> Stray | None:
    """Plant a foreign entry of ``kind`` named like ``step`` (``copy_of``: the shards of a
    checkpoint, for a partial copy); None where this storage cannot hold one (a FIFO on a
    file system with no local path)."""
    driver = location.base.driver
    shards = copy_of or {"model/rank00000.bin": b"\x00" * 100}
    if driver_family(driver) is DriverFamily.FILE_SYSTEM:
        return _plant_on_file_system(driver, kind, step, shards)
    return _plant_on_object_store(driver, kind, step, shards)


def _plant_on_file_system(fs: Any, kind: str, step: int, shards: dict[str, bytes]) -> Stray | None:
    token = step_token(step)
    name = {
        "non-ASCII digits": f"step-{token[5:].translate(_ARABIC_INDIC)}",
        "trailing newline": f"{token}\n",
        "staging-like copy": f"{token}.pending-copy",
        "trash-like directory": ".trash-operator-backup",
    }.get(kind, token)
    mimics_a_leftover = kind in ("staging-like copy", "trash-like directory")
    stray = Stray(_describe(kind, step), None if mimics_a_leftover else step)
    if _exists(fs, name):
        return None  # planted before (the largest step, the trash-like name)
    if kind == "file":
        _write_file(fs, name, b"not a checkpoint\n", stray)
        return stray
    if kind == "manifest is a FIFO" and _local_path(fs, "") is None:
        return None
    _mkdir(fs, name, stray)
    if kind in ("partial copy", "staging-like copy", "trash-like directory"):
        _mkdir(fs, f"{name}/data", stray)
        for shard, data in sorted(shards.items())[: max(1, len(shards) - 1)]:
            segments = shard.split("/")
            for depth in range(1, len(segments)):
                directory = f"{name}/data/{'/'.join(segments[:depth])}"
                if not _exists(fs, directory):
                    _mkdir(fs, directory, stray)
            _write_file(fs, f"{name}/data/{shard}", data, stray)
    elif kind == "manifest is a directory":
        _mkdir(fs, f"{name}/manifest.json", stray)
        stray.damaged = True
    elif kind == "manifest is a FIFO":
        _mkfifo(fs, f"{name}/manifest.json", stray)
        stray.damaged = True
    return stray


def _plant_on_object_store(
    store: Any, kind: str, step: int, shards: dict[str, bytes]
) -> Stray | None:
    token = step_token(step)
    stray = Stray(_describe(kind, step), step)
    manifest = b'{"note": "a copy of a manifest, under a name the protocol never writes"}'
    keys: dict[str, bytes] = {
        "file": {token: b"not a checkpoint\n"},
        "directory marker": {f"{token}/": b""},
        "partial copy": {
            f"{token}/{shard}": data
            for shard, data in sorted(shards.items())[: max(1, len(shards) - 1)]
        },
        "non-ASCII digits": {
            f"{_MANIFESTS}step-{token[5:].translate(_ARABIC_INDIC)}.json": manifest
        },
        "trailing newline": {f"{_MANIFESTS}{token}\n.json": manifest},
        "manifest is a directory marker": {f"{_MANIFESTS}{token}.json/": b""},
        "key under a manifest": {f"{_MANIFESTS}{token}.json/part": manifest},
    }[kind]
    for key in keys:
        with contextlib.suppress(ObjectNotFoundError):
            store.head(key)
            return None  # planted before
    written: list[tuple[str, str | None]] = []
    for key, data in keys.items():
        try:
            written.append((key, store.put(key, data).version_id))
        except CkptStoreError:
            # A name this storage cannot hold (moto answers 404 to a key with a newline):
            # nothing of this kind can be planted here; what was, goes again (each version).
            for planted, version in written:
                with contextlib.suppress(CkptStoreError):
                    store.delete(planted, version_id=version)
            return None
        stray.entries[key] = str(len(data))
    return stray


def plant_pointer(
    location: Any, kind: bytes | str, never_published: int
) -> tuple[Stray, int | None]:
    """Replace the LATEST pointer with a corrupt one of ``kind``; return it and the step it
    names if it parses as one (the model must allow that value)."""
    driver = location.base.driver
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    named: int | None = None
    if kind == "largest step":
        content, named = f"{MAX_STEP}\n".encode(), MAX_STEP
    elif kind == "never published":
        content, named = f"{never_published}\n".encode(), never_published
    elif isinstance(kind, bytes):
        content = kind
    else:
        content = b""
    label = kind.decode("ascii", "backslashreplace") if isinstance(kind, bytes) else kind
    stray = Stray(f"a LATEST pointer planted by the suite ({label!r})", None, must_stay=False)
    if file_system:
        _remove_pointer(driver)
        if kind == "directory":
            _mkdir(driver, _LATEST, stray)
        elif kind == "FIFO":
            if _local_path(driver, "") is None:
                _write_file(driver, _LATEST, b"", stray)
            else:
                _mkfifo(driver, _LATEST, stray)
        else:
            _write_file(driver, _LATEST, content, stray)
        return stray, named
    if kind in ("directory", "FIFO"):  # an object store has neither: a marker and a key below
        with contextlib.suppress(ObjectNotFoundError):
            driver.delete(_LATEST)
        for key in (f"{_LATEST}/", f"{_LATEST}/part"):
            try:
                driver.put(key, b"")
            except CkptStoreError:  # a name this storage cannot hold (fsspec: a final '/')
                continue
            stray.entries[key] = "0"
        stray.must_stay = True  # not the pointer itself: nothing of the protocol's goes there
        return stray, named
    driver.put(_LATEST, content)
    stray.entries[_LATEST] = str(len(content))
    return stray, named


def disturbed(location: Any, stray: Stray) -> list[str]:
    """The planted entries of ``stray`` that are gone or changed kind (empty: all intact)."""
    driver = location.base.driver
    file_system = driver_family(driver) is DriverFamily.FILE_SYSTEM
    changed = []
    for name, kind in sorted(stray.entries.items()):
        try:
            found = _fs_kind(driver, name) if file_system else str(driver.head(name).size)
        except ObjectNotFoundError:
            found = "gone"
        if found != kind:
            changed.append(f"{name!r} ({kind}: now {found})")
    return changed


class FifoGuard:
    """Tells whether a reader ever blocked opening a planted FIFO, and releases it.

    Without it, a reader that opens a FIFO planted as LATEST or as a manifest without
    ``O_NONBLOCK`` would hang the suite forever. The guard looks every ``interval`` seconds
    whether some process holds a FIFO open for reading (an ``O_WRONLY | O_NONBLOCK`` open
    succeeds only then; it also completes the open of a reader blocked in it). Then it reads
    how each reader of this process opened it (``/proc/self/fdinfo``): one without
    ``O_NONBLOCK`` blocked, and is released (the guard writes one byte and closes its end:
    the reader reads it, then end of file); readers with ``O_NONBLOCK`` are correct, however
    long a loaded machine keeps them from closing. A reader of another process (or a system
    without ``/proc``) is judged by time: the guard waits ``confirm`` seconds and writes one
    byte, which fails (EPIPE) once every reader is gone and succeeds if one is still there.
    """

    def __init__(self, interval: float = 0.05, confirm: float = 0.25) -> None:
        self.paths: list[str] = []
        self.blocked: list[str] = []
        self._interval = interval
        self._confirm = confirm
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, path: str) -> None:
        """Watch one more FIFO (a local path); the guard starts with the first."""
        self.paths.append(path)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="fifo-guard", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (and wait for the guard to finish its round)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        """Watch until no watched path is a FIFO any more (removed, or replaced by a publish)."""
        while not self._stop.wait(self._interval):
            fifos = [path for path in list(self.paths) if _is_fifo(path)]
            if not fifos:
                return
            for path in fifos:
                if self._reader_stays(path):
                    self.blocked.append(path)

    def _reader_stays(self, path: str) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False  # ENXIO: nobody reads it; ENOENT: removed
        try:
            fifo = os.fstat(fd)
            if not stat_module.S_ISFIFO(fifo.st_mode):
                return False  # replaced by a regular file meanwhile: never write to it
            here = self._readers_here(fd, fifo)
            if here is False:
                return False
            if here is None:  # not a reader of this process: judged by time
                self._stop.wait(self._confirm)
            return self._still_read(fd) or here is True
        finally:
            os.close(fd)

    def _readers_here(self, own: int, fifo: os.stat_result) -> bool | None:
        """Whether a reader of this process holds the FIFO open without ``O_NONBLOCK`` (True:
        it blocked) or only with it (False); None if none shows within ``confirm`` seconds
        (it closed already, it is another process's, or there is no ``/proc``)."""
        deadline = time.monotonic() + self._confirm
        while True:
            flags = _open_flags(own, fifo)
            if flags is None:
                return None
            if flags:
                return any(not flag & os.O_NONBLOCK for flag in flags)
            if time.monotonic() >= deadline or self._stop.is_set():
                return None
            time.sleep(0.005)

    @staticmethod
    def _still_read(fd: int) -> bool:
        """Write one byte: it succeeds while a reader holds the FIFO (and gives a blocked
        reader something to read; closing then gives it end of file)."""
        try:
            os.write(fd, b"x")
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.EAGAIN):
                return exc.errno == errno.EAGAIN
            raise
        return True


def _holds(name: str, fifo: os.stat_result) -> bool:
    """Whether this process's descriptor ``name`` is open on ``fifo``."""
    held = os.stat(f"/proc/self/fd/{name}")
    return (held.st_dev, held.st_ino) == (fifo.st_dev, fifo.st_ino)


def _open_flags(own: int, fifo: os.stat_result) -> list[int] | None:
    """The open flags of this process's descriptors of ``fifo`` other than ``own`` (None
    where ``/proc/self`` cannot be read)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    flags = []
    for name in names:
        if name == str(own):
            continue
        try:
            if not _holds(name, fifo):
                continue
            with open(f"/proc/self/fdinfo/{name}", encoding="ascii") as info:
                found = [int(line.split()[1], 8) for line in info if line.startswith("flags:")]
            if _holds(name, fifo):  # still the FIFO: the number was not reused in between
                flags.extend(found)
        except (OSError, ValueError):
            continue  # closed meanwhile
    return flags


def fifo_paths(location: Any, stray: Stray) -> list[str]:
    """The local paths of the FIFOs ``stray`` planted (for a ``FifoGuard`` to watch)."""
    driver = location.base.driver
    return [
        path
        for name, kind in stray.entries.items()
        if kind == "fifo" and (path := _local_path(driver, name)) is not None
    ]


def _describe(kind: str, step: int) -> str:
    named = "the largest step" if step == MAX_STEP else f"step {step}"
    return {
        "empty directory": f"an empty directory named like {named} (an operator's mkdir)",
        "file": f"a file named like {named}",
        "directory marker": f"a directory marker key named like {named}",
        "partial copy": f"a partial copy of a checkpoint, named like {named}, without its manifest",
        "non-ASCII digits": f"an entry named like {named} in Arabic-Indic digits",
        "trailing newline": f"an entry named like {named} with a trailing newline",
        "manifest is a directory": f"a directory named like {named} whose manifest is a directory",
        "manifest is a FIFO": f"a directory named like {named} whose manifest is a FIFO",
        "manifest is a directory marker": f"a marker key where {named}'s manifest belongs",
        "key under a manifest": f"a key under the name of {named}'s manifest",
        "staging-like copy": f"an operator's copy named like a staging directory of {named}",
        "trash-like directory": "an operator's directory named like trash (.trash-operator-backup)",
    }[kind]


def _is_fifo(path: str) -> bool:
    try:
        return stat_module.S_ISFIFO(os.lstat(path).st_mode)
    except OSError:
        return False


def _local_path(fs: Any, name: str) -> str | None:
    root = getattr(fs, "root", None)
    if not isinstance(root, str) or not os.path.isdir(root):
        return None
    return os.path.join(root, name) if name else root


def _exists(fs: Any, name: str) -> bool:
    try:
        fs.stat(name)
    except ObjectNotFoundError:
        return False
    return True


def _mkdir(fs: Any, name: str, stray: Stray) -> None:
    fs.mkdir(name)
    stray.entries[name] = "dir"


def _write_file(fs: Any, name: str, data: bytes, stray: Stray) -> None:
    handle = fs.create(name)
    try:
        fs.write(handle, data)
    finally:
        fs.close(handle)
    stray.entries[name] = str(len(data))


def _mkfifo(fs: Any, name: str, stray: Stray) -> None:
    path = _local_path(fs, name)
    assert path is not None
    os.mkfifo(path)
    stray.entries[name] = "fifo"


def _remove_pointer(fs: Any) -> None:
    try:
        if fs.stat(_LATEST).is_dir:
            fs.rmdir(_LATEST)
        else:
            fs.unlink(_LATEST)
    except ObjectNotFoundError:
        return


def _fs_kind(fs: Any, name: str) -> str:
    path = _local_path(fs, name)
    if path is not None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(errno.ENOENT, name) from exc
        if stat_module.S_ISFIFO(mode):
            return "fifo"
    found = fs.stat(name)
    return "dir" if found.is_dir else str(found.size)
