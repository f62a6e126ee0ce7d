"""A simulated POSIX file system that knows what a power loss may leave behind.

``SimulatedFileSystem`` is a file-system driver held in memory. It tracks, for every file, the
bytes written (or cloned from a file outside it: ``clone``) and the bytes made durable by
``fsync``; and for every directory, the entries made durable by ``fsync_dir`` and the metadata
operations (create, mkdir, rename, unlink, rmdir) done since. ``crash_states`` enumerates file
systems a power loss at this instant may legally leave: each un-fsynced operation on directory
entries lost or kept (a rename as one unit, as journaling file systems make it), each file's
un-fsynced data kept, lost, torn (only a prefix written) or zeroed (the size grew, the data did
not arrive). As in ALICE and CrashMonkey, nearly every crash-consistency bug needs at most a few
of these choices to differ from "all kept" or "all lost", so those neighbourhoods are
enumerated completely, together with every in-order prefix of the metadata operations.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from ckptstore.driver import Buffer, Capability, CloningDriver, FileStat, LinkInfo, LinkingDriver
from ckptstore.errors import ObjectNotFoundError, StorageError, TargetExistsError

__all__ = ["CrashState", "SimulatedFileSystem"]

FILE_VARIANTS = ("lost", "torn", "zeroed")


@dataclass
class _Inode:
    is_dir: bool
    mtime: float
    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""
    entries: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Op:
    seq: int
    kind: str
    removes: tuple[tuple[int, str], ...]
    adds: tuple[tuple[int, str, int], ...]


@dataclass(frozen=True)
class CrashState:
    """One file system a power loss may leave: which operations were lost, which data torn."""

    lost_ops: frozenset[int]
    files: tuple[tuple[int, str], ...]

    def describe(self) -> str:
        """A short human description for reports."""
        parts = []
        if self.lost_ops:
            parts.append(f"lost directory ops {sorted(self.lost_ops)}")
        if self.files:
            parts.append(", ".join(f"inode {i} {v}" for i, v in self.files))
        return "; ".join(parts) or "nothing lost"


class SimulatedFileSystem(CloningDriver, LinkingDriver):
    """An in-memory FileSystemDriver with a volatile cache and exact durability bookkeeping.

    It makes clones (``CloningDriver``) as XFS and btrfs do: a clone is the source's bytes as
    they are at that instant, written to the new file and, like written bytes, durable only
    once the file is fsynced.
    """

    capabilities = frozenset(
        {Capability.RENAME_NOREPLACE, Capability.DURABLE_FSYNC, Capability.STRONG_LIST_AFTER_WRITE}
    )

    def __init__(self, clock: Callable[[], float], url: str = "simfs:///") -> None:
        self.url = url
        self.clock = clock
        self.inodes: dict[int, _Inode] = {0: _Inode(True, clock())}
        self.durable_entries: dict[int, dict[str, int]] = {0: {}}
        self.pending: dict[int, list[_Op]] = {0: []}
        self.handles: dict[int, int] = {}
        self.on_change: Callable[[], None] | None = None
        self._next_inode = itertools.count(1)
        self._next_handle = itertools.count(3)
        self._next_seq = itertools.count()

    # -- path resolution -----------------------------------------------------------------

    def _lookup(self, path: str) -> int:
        inode = 0
        for part in filter(None, path.split("/")):
            node = self.inodes[inode]
            if not node.is_dir or part not in node.entries:
                raise ObjectNotFoundError(2, f"{self.url}{path}: no such file or directory")
            inode = node.entries[part]
        return inode

    def _parent(self, path: str) -> tuple[int, str]:
        head, _, name = path.rpartition("/")
        parent = self._lookup(head)
        if not self.inodes[parent].is_dir:
            raise StorageError(20, f"{self.url}{head}: not a directory")
        return parent, name

    def _record(self, kind: str, removes: tuple[tuple[int, str], ...] = (),
                adds: tuple[tuple[int, str, int], ...] = ()) -> None:  # fmt: skip
        op = _Op(next(self._next_seq), kind, removes, adds)
        for directory in {d for d, _ in removes} | {d for d, _, _ in adds}:
            self.pending[directory].append(op)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _link_new(self, path: str, *, is_dir: bool) -> tuple[int, str, int]:
        """A new inode linked at ``path``, whose name must be free: (its directory, its name
        there, the inode)."""
        parent, name = self._parent(path)
        if name in self.inodes[parent].entries:
            raise TargetExistsError(17, f"{self.url}{path}: exists")
        inode = next(self._next_inode)
        self.inodes[inode] = _Inode(is_dir, self.clock())
        self.inodes[parent].entries[name] = inode
        self.inodes[parent].mtime = self.clock()
        return parent, name, inode

    def _existing(self, path: str, missing: str) -> tuple[int, str, _Inode]:
        """The entry at ``path``: (its directory, its name there, its inode); not found, it is
        "no such ``missing``"."""
        parent, name = self._parent(path)
        inode = self.inodes[parent].entries.get(name)
        if inode is None:
            raise ObjectNotFoundError(2, f"{self.url}{path}: no such {missing}")
        return parent, name, self.inodes[inode]

    def _unlink_entry(self, kind: str, parent: int, name: str) -> None:
        """Remove ``name`` from directory ``parent``, recorded as a ``kind`` operation."""
        del self.inodes[parent].entries[name]
        self._record(kind, removes=((parent, name),))

    # -- the driver interface ------------------------------------------------------------

    def ensure_root(self, create: bool) -> None:
        return None

    def mkdir(self, path: str) -> None:
        parent, name, inode = self._link_new(path, is_dir=True)
        self.durable_entries[inode] = {}
        self.pending[inode] = []
        self._record("mkdir", adds=((parent, name, inode),))

    def create(self, path: str) -> int:
        parent, name, inode = self._link_new(path, is_dir=False)
        handle = next(self._next_handle)
        self.handles[handle] = inode
        self._record("create", adds=((parent, name, inode),))
        return handle

    def write(self, handle: int, data: Buffer) -> None:
        node = self.inodes[self.handles[handle]]
        node.data += bytes(data)
        node.mtime = self.clock()
        self._changed()

    def clone(self, handle: int, source: int) -> bool:
        """``FICLONE``: the new file ``handle`` takes the whole of ``source``, a descriptor of a
        real file outside this file system (the trainer's), as it is now. The bytes are the
        file's written, not its durable, bytes: until an fsync of the file a power loss may
        lose, tear or zero them, as a copy's (XFS and btrfs log a clone's shared extents and
        the file's new size in transactions that the file's fsync forces to disk, and no
        earlier)."""
        node = self.inodes[self.handles[handle]]
        node.data = bytearray(_whole_file(source))
        node.mtime = self.clock()
        self._changed()
        return True

    def link(self, source: str, target: str) -> int:
        """A hard link: a new entry for ``source``'s inode, recorded as a directory operation
        (durable once ``target``'s directory is fsynced, lost or kept before, as a create);
        the file's data is the inode's, durable or not, whichever name reads it."""
        _, _, node = self._existing(source, "file")
        if node.is_dir:
            raise StorageError(1, f"{self.url}{source}: a directory is not hard-linked")
        inode = self._lookup(source)
        parent, name = self._parent(target)
        if name in self.inodes[parent].entries:
            raise TargetExistsError(17, f"{self.url}{target}: exists")
        self.inodes[parent].entries[name] = inode
        self.inodes[parent].mtime = node.mtime = self.clock()
        self._record("link", adds=((parent, name, inode),))
        return len(node.data)

    def links(self, path: str) -> LinkInfo:
        inode = self._lookup(path)
        node = self.inodes[inode]
        if node.is_dir:
            raise StorageError(21, f"{self.url}{path}: is a directory")
        count = sum(
            1
            for directory in self.inodes.values()
            if directory.is_dir
            for entry in directory.entries.values()
            if entry == inode
        )
        return LinkInfo(count, node.mtime, (0, inode))

    def start_writeback(self, handle: int) -> None:
        self.inodes[self.handles[handle]]  # only a hint: nothing becomes durable

    def fsync(self, handle: int) -> None:
        inode = self.handles[handle]
        node = self.inodes[inode]
        if node.is_dir:  # a traced fsync of a directory's descriptor (``tracing.replay``)
            self._sync_entries(inode)
        else:
            node.durable = bytes(node.data)
        self._changed()

    def close(self, handle: int) -> None:
        self.handles.pop(handle, None)

    def fsync_dir(self, path: str) -> None:
        self._sync_entries(self._lookup(path))
        self._changed()

    def _sync_entries(self, inode: int) -> None:
        self.durable_entries[inode] = dict(self.inodes[inode].entries)
        self.pending[inode] = []

    def _rename(self, src: str, dst: str, *, replace: bool) -> None:
        source_parent, source_name = self._parent(src)
        target_parent, target_name = self._parent(dst)
        if source_name not in self.inodes[source_parent].entries:
            raise ObjectNotFoundError(2, f"{self.url}{src}: no such file or directory")
        moving = self.inodes[source_parent].entries[source_name]
        existing = self.inodes[target_parent].entries.get(target_name)
        if existing is not None and (
            not replace or self.inodes[existing].is_dir or self.inodes[moving].is_dir
        ):
            raise TargetExistsError(17, f"{self.url}{dst}: exists")
        del self.inodes[source_parent].entries[source_name]
        self.inodes[target_parent].entries[target_name] = moving
        self._record(
            "rename",
            removes=((source_parent, source_name),),
            adds=((target_parent, target_name, moving),),
        )

    def rename_noreplace(self, src: str, dst: str) -> None:
        self._rename(src, dst, replace=False)

    def rename_replace(self, src: str, dst: str) -> None:
        self._rename(src, dst, replace=True)

    def listdir(self, path: str) -> list[str]:
        node = self.inodes[self._lookup(path)]
        if not node.is_dir:
            raise StorageError(20, f"{self.url}{path}: not a directory")
        return sorted(node.entries)

    def stat(self, path: str) -> FileStat:
        node = self.inodes[self._lookup(path)]
        return FileStat(size=len(node.data), mtime=node.mtime, is_dir=node.is_dir)

    def open_read(self, path: str) -> BinaryIO:
        node = self.inodes[self._lookup(path)]
        if node.is_dir:
            raise StorageError(21, f"{self.url}{path}: is a directory")
        return io.BytesIO(bytes(node.data))

    def unlink(self, path: str) -> None:
        parent, name, node = self._existing(path, "file")
        if node.is_dir:
            raise StorageError(21, f"{self.url}{path}: is a directory")
        self._unlink_entry("unlink", parent, name)

    def rmdir(self, path: str) -> None:
        parent, name, node = self._existing(path, "directory")
        if node.entries:
            raise TargetExistsError(39, f"{self.url}{path}: directory not empty")
        self._unlink_entry("rmdir", parent, name)

    # -- replaying a recorded trace (``tracing.replay``) ------------------------------------

    def open_existing(self, path: str) -> int:
        """A handle on an existing file or directory, as a traced ``open`` of it returned."""
        inode = self._lookup(path)
        handle = next(self._next_handle)
        self.handles[handle] = inode
        return handle

    def inode_at(self, path: str) -> int:
        """The inode a path names now; ObjectNotFoundError if none."""
        return self._lookup(path)

    def inode_of(self, handle: int) -> int:
        """The inode an open handle refers to."""
        return self.handles[handle]

    def is_dir(self, inode: int) -> bool:
        """Whether the inode is a directory."""
        return self.inodes[inode].is_dir

    def size_of(self, inode: int) -> int:
        """The bytes written to a file so far."""
        return len(self.inodes[inode].data)

    def path_of(self, inode: int) -> str | None:
        """A path that names the inode now (None once it has no name)."""
        if inode == 0:
            return ""
        todo = [(0, "")]
        while todo:
            directory, prefix = todo.pop()
            for name, child in self.inodes[directory].entries.items():
                path = f"{prefix}{name}"
                if child == inode:
                    return path
                if self.inodes[child].is_dir:
                    todo.append((child, f"{path}/"))
        return None

    # -- power loss ----------------------------------------------------------------------

    def volatile_ops(self) -> list[_Op]:
        """Metadata operations not yet made durable, in the order they were done."""
        unique = {op.seq: op for ops in self.pending.values() for op in ops}
        return [unique[seq] for seq in sorted(unique)]

    def dirty_files(self) -> list[int]:
        """Files whose written bytes are not all durable."""
        return sorted(
            i
            for i, node in self.inodes.items()
            if not node.is_dir and bytes(node.data) != node.durable
        )

    def crash_states(self, *, depth: int = 1) -> Iterator[CrashState]:
        """Distinct states a power loss now may leave, within ``depth`` choices of the extremes."""
        ops = [op.seq for op in self.volatile_ops()]
        files = self.dirty_files()
        units: list[tuple[str, int, str]] = [("op", seq, "lost") for seq in ops]
        units += [("file", inode, variant) for inode in files for variant in FILE_VARIANTS]
        seen: set[CrashState] = set()

        def emit(lost: set[int], variants: dict[int, str]) -> Iterator[CrashState]:
            state = CrashState(frozenset(lost), tuple(sorted(variants.items())))
            if state not in seen:
                seen.add(state)
                yield state

        all_lost_files = dict.fromkeys(files, "lost")
        for count in range(len(ops) + 1):  # in-order prefixes: the journaling model
            yield from emit(set(ops[count:]), {})
            yield from emit(set(ops[count:]), all_lost_files)
        for baseline_lost, baseline_files in ((set(), {}), (set(ops), all_lost_files)):
            for chosen in itertools.chain.from_iterable(
                itertools.combinations(units, k) for k in range(1, depth + 1)
            ):
                lost, variants = set(baseline_lost), dict(baseline_files)
                for kind, key, variant in chosen:
                    if kind == "op":
                        lost.symmetric_difference_update({key})
                    elif variants.get(key) == variant:
                        variants.pop(key)
                    else:
                        variants[key] = variant
                yield from emit(lost, variants)

    def materialise(self, state: CrashState) -> SimulatedFileSystem:
        """The file system as it would be found after a power loss in ``state``."""
        result = SimulatedFileSystem(self.clock, self.url)
        variants = dict(state.files)
        for inode, node in self.inodes.items():
            copy = _Inode(node.is_dir, node.mtime)
            if node.is_dir:
                entries = dict(self.durable_entries.get(inode, {}))
                for op in self.pending.get(inode, []):
                    if op.seq not in state.lost_ops:
                        _apply(op, inode, entries)
                copy.entries = entries
            else:
                copy.data = bytearray(_file_variant(node, variants.get(inode, "kept")))
                copy.durable = bytes(copy.data)
            result.inodes[inode] = copy
            if node.is_dir:
                result.durable_entries[inode] = dict(copy.entries)
                result.pending[inode] = []
        result._next_inode = itertools.count(max(self.inodes) + 1)
        return result


def _whole_file(descriptor: int) -> bytes:
    """Every byte of the open file ``descriptor``, read from offset 0 (its position unmoved)."""
    chunks, offset = [], 0
    while chunk := os.pread(descriptor, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _apply(op: _Op, directory: int, entries: dict[str, int]) -> None:
    for parent, name in op.removes:
        if parent == directory:
            entries.pop(name, None)
    for parent, name, inode in op.adds:
        if parent == directory:
            entries[name] = inode


def _file_variant(node: _Inode, variant: str) -> bytes:
    data = bytes(node.data)
    if variant == "kept":
        return data
    if variant == "lost":
        return node.durable
    base = node.durable if data.startswith(node.durable) else b""
    if variant == "torn":
        return data[: len(base) + (len(data) - len(base)) // 2]
    return base + b"\x00" * (len(data) - len(base))
