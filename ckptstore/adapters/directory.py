"""A checkpoint directory written by a trainer's own code, published as one checkpoint (all its
files or none), and a checkpoint materialised back into a local directory (verified, complete
or absent).

Hugging Face ``Trainer``, Accelerate's ``save_state``, NeMo and Megatron write a checkpoint as
a directory of files, in place and one file at a time: a crash leaves a directory that looks
like a checkpoint and is not one. ``publish_directory`` gives such a directory ckptstore's
guarantees on any store: every regular file becomes a shard named by its path relative to the
directory, streamed, several at once, and one atomic commit publishes them together.
``materialize`` writes a checkpoint's shards into a temporary sibling of the target, checks
every byte against the manifest's CRC32C, fsyncs it and renames it into place, so the target
directory is either the whole checkpoint or untouched.

Empty directories are not kept (a shard is a file). A symbolic link is refused unless the
caller opts in (``follow_symlinks=True``, ``push --follow-symlinks``): then a link to a file is
stored as the file it points to. Any other entry (a link to a directory, a socket, a FIFO, a
device) is refused. Every file is opened without following a link and without blocking, and
must still be the file that was listed (same device, inode and type), so a file swapped for a
link or a FIFO after the listing is refused, never read. A store on the local file system
inside the directory (or the directory inside the store) is refused.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckptstore.adapters.localdir import (
    check_target,
    fsync_directory,
    locked,
    recover,
    replaceable,
    staging_path,
    swap_in,
)
from ckptstore.checkpoint import Checkpoint
from ckptstore.errors import (
    CapabilityError,
    CkptStoreError,
    InvalidInputError,
    StorageAccessDeniedError,
    StorageError,
)
from ckptstore.filekind import file_kind
from ckptstore.interface import CheckpointStore
from ckptstore.names import check_shard_name
from ckptstore.pending import PendingCheckpoint
from ckptstore.shardbytes import FileBytes
from ckptstore.store import Store
from ckptstore.urls import parse_url

__all__ = ["DirectoryFile", "directory_files", "materialize", "publish_directory", "write_files"]

DEFAULT_PARALLEL = 8
"""Files streamed at once: enough to keep an object store's connections busy."""
_COPY_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class DirectoryFile:
    """A file to publish: its shard name (relative path, '/'-separated) and where it is.

    ``device`` and ``inode`` identify the file that was listed (for a followed link: the file
    it pointed to); ``follow`` says it was reached through a symbolic link; ``modified``: its
    modification time (ns) when listed. The read opens the path again and refuses anything but
    that same regular file, and a file whose size or modification time is not the listed one
    once it has been read (written meanwhile: its bytes may mix two versions)."""

    name: str
    path: Path
    size: int
    device: int | None = None
    inode: int | None = None
    follow: bool = False
    modified: int | None = None


def directory_files(
    directory: str | os.PathLike[str], *, follow_symlinks: bool = False
) -> list[DirectoryFile]:
    """Every file under ``directory`` as it will be published, sorted by name.

    Raises InvalidInputError for a missing directory, a symbolic link (unless
    ``follow_symlinks``: then a link to a file is published as that file), an entry that is
    neither a file nor a directory, or a file name that is not a valid shard name.
    """
    root = Path(directory)
    if not root.is_dir():
        raise InvalidInputError(f"{root}: not a directory")
    found: list[DirectoryFile] = []
    top = os.path.realpath(root)
    # Walked by directory descriptors: a directory swapped for a link while it is listed is
    # not walked into (the read then checks each file is the one listed).
    for folder, subfolders, names, fd in os.fwalk(top, onerror=_raise_walk_error):
        within = os.path.relpath(folder, top)
        here = root if within == "." else root / within
        for name in [*names, *subfolders]:
            path = here / name
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
            if stat.S_ISDIR(info.st_mode):
                continue  # walked into next
            follow = stat.S_ISLNK(info.st_mode)
            if follow:
                info = _linked_file(path, name, fd, follow_symlinks)
            elif not stat.S_ISREG(info.st_mode):
                raise InvalidInputError(
                    f"{path}: not a regular file ({_kind(info.st_mode)}; only files are published)"
                )
            relative = path.relative_to(root).as_posix()
            try:
                check_shard_name(relative)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{path}: cannot be published: {exc}") from exc
            found.append(
                DirectoryFile(
                    relative,
                    path,
                    info.st_size,
                    info.st_dev,
                    info.st_ino,
                    follow,
                    info.st_mtime_ns,
                )
            )
    return sorted(found, key=lambda f: f.name)


def _linked_file(path: Path, name: str, fd: int, follow_symlinks: bool) -> os.stat_result:
    """What the symbolic link ``path`` (``name`` in directory ``fd``) points to, if it may be
    published: a regular file, and ``follow_symlinks``; else InvalidInputError, one line that
    says which case it is."""
    try:
        target = os.readlink(name, dir_fd=fd)
    except OSError:
        target = "?"
    try:
        info = os.stat(name, dir_fd=fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InvalidInputError(
                f"{path}: a symbolic link loop (-> {target}): following it never reaches a "
                f"file; remove it"
            ) from None
        if exc.errno == errno.ENOENT:
            raise InvalidInputError(
                f"{path}: a dangling symbolic link (-> {target}): nothing is there"
            ) from None
        raise InvalidInputError(
            f"{path}: a symbolic link (-> {target}) that cannot be followed: {exc.strerror or exc}"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise InvalidInputError(
            f"{path}: a symbolic link to something other than a file (-> {target}, "
            f"{_kind(info.st_mode)}; only files are published)"
        )
    if not follow_symlinks:
        raise InvalidInputError(
            f"{path}: a symbolic link (-> {target}); only regular files are published: "
            f"copy the file in, or opt in to publish what links point to "
            f"(push --follow-symlinks, follow_symlinks=True)"
        )
    return info


def _kind(mode: int) -> str:
    return file_kind(mode, "not a regular file")


def _raise_walk_error(error: OSError) -> None:
    raise InvalidInputError(f"cannot read {error.filename}: {error.strerror}") from error


def publish_directory(
    store: CheckpointStore,
    step: int,
    directory: str | os.PathLike[str],
    *,
    metadata: Mapping[str, object] | None = None,
    parallel: int = DEFAULT_PARALLEL,
    epoch: int | None = None,
    follow_symlinks: bool = False,
    clone: bool = False,
) -> Checkpoint:
    """Publish every file under ``directory`` as checkpoint ``step``, in one commit.

    Files are streamed ``parallel`` at a time. On any error nothing is published and what was
    written is removed. The directory must not change while it is published: a file that
    shrinks or grows under the read, or is replaced by another, is refused. ``epoch``: write
    in that epoch (``Store.join_epoch``; SupersededError if a newer one took the store over);
    by default the store's own (docs/protocol.md §8.3: once the store has been taken over, a
    store that neither took it over nor joined an epoch is refused). ``follow_symlinks``:
    publish what symbolic links to files point to, instead of refusing them. ``clone``: on a
    file-system store whose file system makes copy-on-write clones (reflinks: XFS, btrfs),
    each file on that same file system becomes its shard without a byte copied (the clone is
    then read once for its checksums); anywhere else, or where a clone fails for want of
    support, the bytes are copied as usual.
    """
    if parallel < 1:
        raise InvalidInputError(f"parallel must be at least 1, got {parallel}")
    if epoch is not None:
        if not isinstance(store, Store):
            raise CapabilityError(
                f"{store.url}: epoch={epoch} names an epoch of one store; a tiered pair's "
                f"epochs are its takeover's (TieredStore.take_over, or join_epochs)",
                url=store.url,
            )
        if store.epoch is None:
            store.join_epoch(epoch)
        elif store.epoch != epoch:
            raise InvalidInputError(
                f"{store.url}: this store writes in epoch {store.epoch}, not epoch {epoch}: "
                f"open another to publish in epoch {epoch}",
                url=store.url,
            )
    refuse_nested(store.url, directory)
    files = directory_files(directory, follow_symlinks=follow_symlinks)
    with store.begin(step, metadata) as pending:
        write_files(pending, files, parallel=parallel, clone=clone)
    assert pending.checkpoint is not None
    return pending.checkpoint


_LOCAL_SCHEMES = frozenset({"file", "lustre", "fsspec+file", "fsspec+local"})


def refuse_nested(url: str, directory: str | os.PathLike[str]) -> None:
    """InvalidInputError if the store at ``url`` lies on this machine inside ``directory``, or
    the directory inside the store: each publish would copy the earlier checkpoints into the
    new one (or a store's own files into itself). Real paths are compared."""
    parsed = parse_url(url)
    if parsed.scheme not in _LOCAL_SCHEMES:
        return
    where = Path(os.path.realpath(directory))
    root = Path(os.path.realpath(parsed.path or "/"))
    if root == where or where in root.parents:
        raise InvalidInputError(
            f"{directory}: the store at {root} is inside the directory being published, so "
            f"every push would copy the store's earlier checkpoints into the new one; keep "
            f"the store outside it"
        )
    if root in where.parents:
        raise InvalidInputError(
            f"{directory}: inside the store at {root}; publish a directory from outside the "
            f"store (ckptstore pull writes a checkpoint out as a directory)"
        )


def write_files(
    pending: PendingCheckpoint,
    files: list[DirectoryFile],
    *,
    parallel: int = DEFAULT_PARALLEL,
    clone: bool = False,
) -> None:
    """Write ``files`` (from ``directory_files``) as shards of ``pending``, ``parallel`` at a
    time: a part of a directory, when several machines each hold some of its files.
    ``clone``: where the store is a file system that makes copy-on-write clones of files
    (reflinks) and the files are on it, each shard is a clone, no byte copied."""
    if parallel < 1:
        raise InvalidInputError(f"parallel must be at least 1, got {parallel}")
    _run_all(parallel, [functools.partial(_publish_file, pending, f, clone) for f in files])


@contextlib.contextmanager
def _local(action: str, path: Path) -> Iterator[None]:
    """A local file system's OSError as a StorageError naming the path (one hierarchy)."""
    try:
        yield
    except CkptStoreError:
        raise
    except OSError as exc:
        kind = StorageAccessDeniedError if isinstance(exc, PermissionError) else StorageError
        error = kind(f"cannot {action} {path}: {exc.strerror or exc}")
        error.errno = exc.errno
        raise error from exc


def _publish_file(pending: PendingCheckpoint, file: DirectoryFile, clone: bool = False) -> None:
    with _local("read", file.path), _opened(file) as source:
        if pending.shares and not clone:  # an incremental save: shared where already stored
            pending.write(file.name, FileBytes(source.fileno(), file.size, str(file.path)))
            try:  # FileBytes raised if the file ended early
                _check_unchanged(file, source, file.size)
            except BaseException:
                pending.discard(file.name)
                raise
            return
        with pending.open_shard(file.name, file.size) as shard:
            copied = 0
            if clone and file.size and shard.clone_from(source.fileno()):
                copied = shard.size  # a reflink of the file as it was then, checksummed
            else:
                view = memoryview(bytearray(min(_COPY_CHUNK, max(file.size, 1))))
                while count := source.readinto(view):
                    shard.write(view[:count])
                    copied += count
            _check_unchanged(file, source, copied)


def _check_unchanged(file: DirectoryFile, source: io.BufferedReader, copied: int) -> None:
    """InvalidInputError if ``file`` changed while ``copied`` bytes of it were read."""
    after = os.fstat(source.fileno())
    rewritten = file.modified is not None and after.st_mtime_ns != file.modified
    if copied == file.size and after.st_size != file.size:
        raise InvalidInputError(
            f"{file.path} changed while it was published ({file.size} bytes when listed and "
            f"read, {after.st_size} now): publish a directory only once its writer is done"
        )
    if copied == file.size and rewritten:
        raise InvalidInputError(
            f"{file.path} changed while it was published (written again after it was "
            f"listed: what was read may mix two versions of it); nothing was "
            f"published: publish a directory only once its writer is done"
        )
    if copied != file.size:
        raise InvalidInputError(
            f"{file.path} changed while it was published ({file.size} bytes when listed, "
            f"{copied} read): publish a directory only once its writer is done"
        )


_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def _opened(file: DirectoryFile) -> Iterator[io.BufferedReader]:
    """``file`` opened for reading: never through a link it was not listed as (O_NOFOLLOW),
    never blocking (O_NONBLOCK: a FIFO swapped in opens at once), and only if it is still the
    regular file that was listed (device and inode), else InvalidInputError."""
    flags = _READ_FLAGS if file.follow else _READ_FLAGS | os.O_NOFOLLOW
    try:
        fd = os.open(file.path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link, or a followed link now loops
            raise _swapped(file, "a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _swapped(file, _kind(info.st_mode))
        if file.inode is not None and (info.st_dev, info.st_ino) != (file.device, file.inode):
            raise _swapped(file, "another file")
        os.set_blocking(fd, True)
        source = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with source:
        yield source


def _swapped(file: DirectoryFile, now: str) -> InvalidInputError:
    return InvalidInputError(
        f"{file.path} was replaced after it was listed (now {now}): nothing was published; "
        f"publish a directory only once its writer is done, and where no one else writes"
    )


def materialize(
    checkpoint: Checkpoint,
    directory: str | os.PathLike[str],
    *,
    replace: bool = False,
    parallel: int = DEFAULT_PARALLEL,
) -> Path:
    """Write every shard of ``checkpoint`` as a file under ``directory``; return its path.

    The files go into a temporary sibling first; each is verified against its CRC32C while it
    is written and fsynced; then the sibling is renamed to ``directory``. A directory already
    there is refused unless ``replace``, and ``replace`` swaps out (renames aside, then removes)
    only a directory that an earlier materialize made and that still holds what it wrote, as
    the marker ``.<name>.ckptstore-pulled`` beside it records: anything else (the user's own
    directory, a symbolic link, one an older ckptstore pulled) is refused before anything is
    moved. Materializations of one target take turns (a lock file beside it, removed when
    done). A crash leaves the old directory or the new one, and ``.<name>.ckptstore-*``
    siblings that the next materialize of the same target clears up: had the crash come
    between the two renames of a swap, the old directory is put back first. See
    ``ckptstore.adapters.localdir`` for every file made beside the target.
    """
    if parallel < 1:
        raise InvalidInputError(f"parallel must be at least 1, got {parallel}")
    target = Path(directory).absolute()
    check_target(target)
    with _local("create", target.parent):
        target.parent.mkdir(parents=True, exist_ok=True)
    with _local("lock", target), locked(target):
        recover(target)
        old = None
        if _exists(target):
            if not replace:
                raise InvalidInputError(
                    f"{target} already exists (replace=True swaps it out if a pull made it)"
                )
            old = replaceable(target)  # refused before anything is moved
        staging = staging_path(target)
        try:
            with _local("create", staging):
                staging.mkdir()
                folders = _make_folders(staging, checkpoint.names)
            _run_all(
                parallel,
                [
                    functools.partial(_materialize_file, checkpoint, n, staging / n)
                    for n in checkpoint.names
                ],
            )
            with _local("sync", staging):
                for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
                    fsync_directory(folder)
            with _local("replace", target):
                swap_in(staging, target, old)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _exists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _make_folders(staging: Path, names: list[str]) -> set[Path]:
    """Create the directories the shard names need; refuse names that collide as paths."""
    files = set(names)
    folders = {staging}
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            prefix = "/".join(parts[:depth])
            if prefix in files:
                raise InvalidInputError(
                    f"shards {prefix!r} and {name!r} cannot both be files in a directory", key=name
                )
            folders.add(staging / prefix)
    for folder in sorted(folders, key=lambda p: len(p.parts)):
        folder.mkdir(exist_ok=True)
    return folders


def _materialize_file(checkpoint: Checkpoint, name: str, path: Path) -> None:
    view = memoryview(bytearray(_COPY_CHUNK))
    with checkpoint.open(name) as source, _local("write", path), open(path, "xb") as target:
        while count := source.readinto(view):  # verified against the CRC32C at the end
            target.write(view[:count])
        target.flush()
        os.fsync(target.fileno())


def _run_all(parallel: int, tasks: list[Callable[[], None]]) -> None:
    """Run every task, ``parallel`` at a time; the first error stops what has not started and
    is raised once the running ones end."""
    with ThreadPoolExecutor(parallel, thread_name_prefix="ckptstore-dir") as pool:
        futures: list[Future[None]] = [pool.submit(task) for task in tasks]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
