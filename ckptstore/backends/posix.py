"""POSIX file-system driver: real files, real fsync, and ``renameat2(RENAME_NOREPLACE)``.

``file:///abs/path`` (or a bare path) opens a store in that directory with the rename commit
protocol (``ckptstore.commit.rename``). Every OSError is translated here, once, into the
``StorageError`` subclass that names the path and the cause.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat as stat_module
import threading
from collections.abc import Iterator, Mapping
from typing import BinaryIO, ClassVar

from ckptstore.commit.rename import RenameCommit
from ckptstore.driver import (
    Buffer,
    Capability,
    CloningDriver,
    FileStat,
    LinkInfo,
    LinkingDriver,
)
from ckptstore.errors import (
    InvalidURLError,
    ObjectNotFoundError,
    StorageAccessDeniedError,
    StorageError,
    StoreNotFoundError,
    TargetExistsError,
)
from ckptstore.filekind import file_kind
from ckptstore.urls import StoreURL, file_url

__all__ = ["PosixDriver", "open_posix"]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_WRITE_CHUNK = 64 * 1024 * 1024
_FICLONE = 0x40049409
"""Linux's ``FICLONE`` ioctl: ``_IOW(0x94, 9, int)``."""
_NO_CLONES = frozenset(
    {
        errno.EOPNOTSUPP,
        errno.ENOTSUP,
        errno.EXDEV,
        errno.EINVAL,
        errno.ENOTTY,
        errno.ENOSYS,
        errno.EBADF,
    }
)
"""What ``FICLONE`` answers where no clone can be made (ext4, tmpfs, another file system)."""
_READ_BUFFER = 1024 * 1024
_READ_FLAGS = (
    os.O_RDONLY
    | os.O_NONBLOCK  # a FIFO must not block the open
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NOCTTY", 0)  # a terminal device must not become the controlling one
    | getattr(os, "O_CLOEXEC", 0)
)


_SYNC_FILE_RANGE_WRITE = 2


def _libc_function(name: str, argtypes: list[type], restype: type) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def _load_renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return _libc_function(
        "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint],
        ctypes.c_int,
    )  # fmt: skip


class PosixDriver(CloningDriver, LinkingDriver):
    """File-system primitives under one root directory, each one system call deep."""

    capabilities = frozenset(
        {Capability.RENAME_NOREPLACE, Capability.DURABLE_FSYNC, Capability.STRONG_LIST_AFTER_WRITE}
    )
    _renameat2 = _load_renameat2()
    _sync_file_range = _libc_function(
        "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
        ctypes.c_int,
    )  # fmt: skip
    _renameat2_works: ClassVar[dict[int, bool]] = {}
    """Per file system (``st_dev``): whether renameat2(RENAME_NOREPLACE) works there."""
    _probe_lock = threading.Lock()

    def __init__(self, root: str) -> None:
        if not os.path.isabs(root):
            raise InvalidURLError(f"POSIX store root must be an absolute path, got {root!r}")
        self.root = os.path.normpath(root)
        self.url = file_url(self.root)
        self._paths: dict[int, str] = {}
        self._root_device: int | None = None

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    @contextlib.contextmanager
    def _translate(self, op: str, path: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise _translated(exc, f"{op} {self._abs(path)}") from exc

    @contextlib.contextmanager
    def _translate_handle(self, op: str, handle: int, path: str | None = None) -> Iterator[None]:
        """Translate an error of a call on an open file, naming the file's path, not its fd."""
        try:
            yield
        except OSError as exc:
            path = path if path is not None else self._paths.get(handle)
            what = self._abs(path) if path is not None else f"{self.url} <fd {handle}>"
            raise _translated(exc, f"{op} {what}") from exc

    def _opened(self, handle: int, path: str) -> int:
        """Remember which path a new handle writes, for the messages of its errors."""
        self._paths[handle] = path
        return handle

    def ensure_root(self, create: bool) -> None:
        if os.path.isdir(self.root):
            return
        if os.path.lexists(self.root):
            if os.path.isdir(self.root):  # another process made it since (ranks open at once)
                with self._translate("create store directory", ""):
                    self._fsync_path(os.path.dirname(self.root))  # durable, if not yet
                return
            raise StoreNotFoundError(f"{self.url}: exists but is not a directory")
        if not create:
            raise StoreNotFoundError(f"{self.url}: no such directory (no checkpoints here)")
        missing = []
        head = self.root
        while not os.path.lexists(head):
            missing.append(head)
            head = os.path.dirname(head)
        with self._translate("create store directory", ""):
            os.makedirs(self.root, exist_ok=True)
            for directory in [*missing[1:], head]:  # make each new entry durable in its parent
                self._fsync_path(directory)

    def mkdir(self, path: str) -> None:
        with self._translate("mkdir", path):
            os.mkdir(self._abs(path))

    def create(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        with self._translate("create", path):
            return self._opened(os.open(self._abs(path), flags, 0o644), path)

    def clone(self, handle: int, source: int) -> bool:
        """Make the new, empty file ``handle`` a copy-on-write clone of the whole open file
        ``source`` (``FICLONE``: XFS, btrfs, bcachefs, OCFS2, NFS 4.2 where the server has
        it); False, with nothing changed, where the file system makes no clones or the two
        files are on different file systems. Durable once ``handle`` is fsynced."""
        with self._translate_handle("clone", handle):
            try:
                fcntl.ioctl(handle, _FICLONE, source)
            except OSError as exc:
                if exc.errno in _NO_CLONES:
                    return False
                raise
        return True

    def link(self, source: str, target: str) -> int:
        """A hard link (``linkat`` without ``AT_SYMLINK_FOLLOW``: a symbolic link is linked
        as itself, then refused); the file's size."""
        with self._translate("link", f"{source} -> {target}"):
            os.link(self._abs(source), self._abs(target), follow_symlinks=False)
        try:
            with self._translate("stat", target):
                result = os.lstat(self._abs(target))
            if not stat_module.S_ISREG(result.st_mode):
                raise _not_regular(self._abs(source), file_kind(result.st_mode, "not a file"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self._abs(target))
            raise
        return result.st_size

    def links(self, path: str) -> LinkInfo:
        with self._translate("stat", path):
            result = os.lstat(self._abs(path))
        if not stat_module.S_ISREG(result.st_mode):
            raise _not_regular(self._abs(path), file_kind(result.st_mode, "not a file"))
        return LinkInfo(result.st_nlink, result.st_ctime, (result.st_dev, result.st_ino))

    def write(self, handle: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        with self._translate_handle("write", handle):
            while view.nbytes:
                written = os.write(handle, view[:_WRITE_CHUNK])
                view = view[written:]

    def start_writeback(self, handle: int) -> None:
        # sync_file_range(SYNC_FILE_RANGE_WRITE) queues the file's dirty pages for writing and
        # returns; it makes nothing durable (no metadata, no device cache flush): fsync does.
        # Where it is missing or fails (not Linux, a file system without it) it is skipped.
        if self._sync_file_range is not None:
            self._sync_file_range(handle, 0, 0, _SYNC_FILE_RANGE_WRITE)

    def fsync(self, handle: int) -> None:
        with self._translate_handle("fsync", handle):
            os.fsync(handle)

    def close(self, handle: int) -> None:
        # Forgotten before the descriptor's number is free: another thread's create may reuse
        # it at once, and its path must not be forgotten in its place.
        path = self._paths.pop(handle, None)
        with self._translate_handle("close", handle, path):
            os.close(handle)

    def fsync_dir(self, path: str) -> None:
        with self._translate("fsync directory", path):
            self._fsync_path(self._abs(path))

    @staticmethod
    def _fsync_path(path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename_noreplace(self, src: str, dst: str) -> None:
        source, target = self._abs(src), self._abs(dst)
        with self._translate("rename", f"{src} -> {dst}"):
            if self._try_renameat2(source, target):
                return
            # Fallback without renameat2: safe for directories only, and ckptstore renames
            # only directories this way. rename(2) never replaces a non-empty directory, and a
            # published checkpoint directory always holds its manifest.
            if os.path.lexists(target):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target)
            if not os.path.isdir(source):
                if not os.path.lexists(source):
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), source)
                raise IsADirectoryError(errno.EINVAL, "no-replace rename of a file", source)
            os.rename(source, target)

    def _try_renameat2(self, source: str, target: str) -> bool:
        """Rename with RENAME_NOREPLACE; return False where the kernel or file system lacks it."""
        fn = self._renameat2
        if fn is None:
            return False
        device = self._device()
        works = self._renameat2_works
        if works.get(device) is False:
            return False
        result = fn(
            _AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE
        )
        if result == 0:
            with self._probe_lock:
                works[device] = True
            return True
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL):
            with self._probe_lock:  # once it worked here, EINVAL is the call's own
                works.setdefault(device, False)
            return False
        raise OSError(err, os.strerror(err), source, None, target)

    def _device(self) -> int:
        """The file system (``st_dev``) of the store's root."""
        if self._root_device is None:
            self._root_device = os.stat(self.root).st_dev
        return self._root_device

    def rename_replace(self, src: str, dst: str) -> None:
        with self._translate("rename", f"{src} -> {dst}"):
            os.replace(self._abs(src), self._abs(dst))

    def listdir(self, path: str) -> list[str]:
        with self._translate("list", path):
            return sorted(os.listdir(self._abs(path)))

    def stat(self, path: str) -> FileStat:
        with self._translate("stat", path):
            result = os.lstat(self._abs(path))
        return FileStat(
            size=result.st_size,
            mtime=result.st_mtime,
            is_dir=stat_module.S_ISDIR(result.st_mode),
        )

    def open_read(self, path: str) -> BinaryIO:
        """Open a regular file for reading; anything else is a StorageError, never a wait.

        A FIFO planted as ``LATEST`` or as a manifest would block a plain open (and then every
        read) until a writer appears: the open does not block (O_NONBLOCK), a non-regular file
        is refused after it (errno EISDIR for a directory, EINVAL for a FIFO, device or
        symbolic link), and only a regular file is read, in blocking mode. The store never
        makes a symbolic link, so a final one (O_NOFOLLOW) is refused rather than followed
        out of the store.
        """
        where = self._abs(path)
        try:
            fd = os.open(where, _READ_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _not_regular(where, "a symbolic link") from exc
            raise _translated(exc, f"open {where}") from exc
        try:
            with self._translate("open", path):
                mode = os.fstat(fd).st_mode
            if not stat_module.S_ISREG(mode):
                raise _not_regular(where, file_kind(mode, f"file mode {mode:o}"))
            with self._translate("open", path):
                os.set_blocking(fd, True)  # reads of a regular file wait for the disk
                stream = os.fdopen(fd, "rb", buffering=_READ_BUFFER)
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError, AttributeError):  # a hint: twice the readahead
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return stream

    def unlink(self, path: str) -> None:
        with self._translate("unlink", path):
            os.unlink(self._abs(path))

    def rmdir(self, path: str) -> None:
        with self._translate("rmdir", path):
            os.rmdir(self._abs(path))


def _not_regular(where: str, kind: str) -> StorageError:
    code = errno.EISDIR if kind == "a directory" else errno.EINVAL
    return StorageError(code, f"open {where}: not a regular file ({kind})")


def _translated(exc: OSError, what: str) -> StorageError:
    message = f"{what}: {exc.strerror or exc}"
    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOTDIR:
        # ENOTDIR: a component of the path is a file (a stray named like a step, say), so
        # nothing exists at the path: the same answer as ENOENT.
        return ObjectNotFoundError(errno.ENOENT, message)
    if isinstance(exc, FileExistsError) or exc.errno == errno.ENOTEMPTY:
        return TargetExistsError(errno.EEXIST, message)
    if isinstance(exc, PermissionError):
        return StorageAccessDeniedError(exc.errno, message)
    return StorageError(exc.errno, message)


def open_posix(url: StoreURL, options: Mapping[str, object]) -> RenameCommit:
    """Open a ``file://`` store: PosixDriver + RenameCommit."""
    url.reject_unknown(options, allowed=())
    if url.netloc not in ("", "localhost"):
        raise InvalidURLError(
            f"{url.shown}: file:// URLs take an absolute path (file:///abs/path), "
            f"not a host {url.netloc.rpartition('@')[2]!r}"
        )
    return RenameCommit(PosixDriver(url.path))
