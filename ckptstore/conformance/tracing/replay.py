"""A recorded trace judged twice: each durability call against what reached the kernel, and
every power-loss state of the recorded system calls against the model.

The trace (``strace``) is replayed, in order, into a ``SimulatedFileSystem`` rooted at
the store: every open is resolved to a simulated inode (through ``openat``'s directory
descriptor, ``dup`` and ``close``), every write, ``mkdir``, rename and unlink is applied, and
an ``fsync`` takes effect only on the inode its descriptor refers to. Two checks follow.

(a) Each durability call of the strategy must reach the kernel on the right object: the
driver's ``fsync(handle)`` as ``fsync``/``fdatasync`` of a descriptor of the file that handle
was created for, ``fsync_dir(path)`` as one of a descriptor of that directory (else I2: the
data or entries may be lost), ``rename_noreplace`` as ``renameat2(RENAME_NOREPLACE)`` (else
I5: a racing writer's step can be replaced). The POSIX driver's documented fallback, a plain
rename of a directory once the kernel refused the flag (EINVAL, ENOSYS), is accepted.

(b) As ALICE does (Pillai et al., OSDI '14), the file system is cut before every recorded
``fsync`` and rename and at the end, and every state a power loss may leave there
(``models.simfs.crash_states``) is checked with ``check_invariants`` against the model as it stood
(the traced process records it at each driver call).

The replay stops where the trace leaves the model: a system call it does not model on the
store (``writev``, ``ftruncate``, a write longer than strace printed) ends the power-loss
states; a hard link, a rename into or out of the store, or a call whose effect the simulation
refuses (it diverged) ends both checks. Either is said in the coverage line.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any

from ckptstore.commit.base import CommitStrategy
from ckptstore.conformance.layers.cases import CaseFailure
from ckptstore.conformance.location import Clock
from ckptstore.conformance.model import InvariantViolation, Model, check_invariants
from ckptstore.conformance.models.simfs import SimulatedFileSystem
from ckptstore.conformance.tracing.child import MARK, DriverCall, TraceOutcome
from ckptstore.conformance.tracing.strace import Syscall, decode_string
from ckptstore.errors import CkptStoreError
from ckptstore.store import Store

__all__ = ["ReplayResult", "replay_trace"]

MAX_FAILURES = 20
SYNC_CALLS = frozenset({"fsync", "fdatasync"})
RENAME_CALLS = frozenset({"rename", "renameat", "renameat2"})
_DATA_CALLS = frozenset({"writev", "pwritev", "pwritev2", "ftruncate", "fallocate", "truncate"})
_NAME_CALLS = frozenset({"link", "linkat", "symlink", "symlinkat"})
_REFUSED = frozenset({"EINVAL", "ENOSYS"})


@dataclass
class ReplayResult:
    """What the trace held, what was matched and checked, and what broke."""

    syscalls: int = 0
    """System calls of the workload (from its first driver call on), the markers not counted."""
    store_syscalls: int = 0
    """System calls on the store (its paths, or descriptors open on them)."""
    durability_calls: int = 0
    """Driver fsync, fsync_dir and rename_noreplace calls that returned and were judged."""
    matched: int = 0
    cuts: int = 0
    states: int = 0
    failures: list[CaseFailure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, case: str, invariant: str, message: str) -> None:
        """Record a finding (the first ``MAX_FAILURES``)."""
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(CaseFailure(case, invariant, message))


@dataclass
class _Fd:
    path: str
    """The absolute path it was opened by."""
    handle: int | None
    """Its simulated handle, where it is open on the store."""


@dataclass
class _Window:
    """What the kernel was asked during one driver call (by the thread that made it)."""

    call: DriverCall
    expected: int | None
    syncs: list[tuple[int | None, str]] = field(default_factory=list)
    renames: list[tuple[Syscall, bool]] = field(default_factory=list)
    """Each rename-like system call, and whether it renamed a directory."""


def replay_trace(
    syscalls: list[Syscall],
    outcome: TraceOutcome,
    strategy: CommitStrategy[Any],
    *,
    root: str,
    cwd: str,
    depth: int = 1,
) -> ReplayResult:
    """Replay ``syscalls`` of the traced workload under store ``root``; judge and cut them."""
    replay = _Replay(outcome, strategy, os.path.normpath(root), cwd, depth)
    for call in syscalls:
        replay.apply(call)
    replay.cut("the end of the trace")
    if replay.fallbacks:
        replay.result.notes.append(
            f"{replay.fallbacks} no-replace rename(s) of directories by the driver's documented "
            f"fallback, rename(2) after the kernel refused RENAME_NOREPLACE"
        )
    if replay.stopped_cuts:
        replay.result.notes.append(f"power-loss states stopped: {replay.stopped_cuts}")
    if replay.diverged:
        replay.result.notes.append(f"replay stopped: {replay.diverged}")
    return replay.result


class _Replay:
    """The simulated file system, descriptor table and driver-call windows of one trace."""

    def __init__(
        self,
        outcome: TraceOutcome,
        strategy: CommitStrategy[Any],
        root: str,
        cwd: str,
        depth: int,
    ) -> None:
        self.outcome = outcome
        self.strategy = strategy
        self.root = root
        self.cwd = cwd
        self.depth = depth
        self.clock = Clock()
        self.sim = SimulatedFileSystem(self.clock)
        self.fds: dict[int, _Fd] = {}
        self.windows: dict[int, _Window] = {}
        self.created: dict[Any, int] = {}
        """The driver's file handles -> the simulated inode each was created for."""
        self.model = pickle.dumps(Model())
        self.started = False
        self.noreplace_refused = False
        self.fallbacks = 0
        self.diverged: str | None = None
        self.stopped_cuts: str | None = None
        self.result = ReplayResult()

    # -- dispatch ------------------------------------------------------------------------

    def apply(self, call: Syscall) -> None:
        marker = _marker(call)
        if marker is not None:  # the traced process's own mark, not the driver's call
            self._boundary(call.tid, *marker)
            self.started = True
            return
        if self.started:  # the workload's, not the interpreter's start-up
            self.result.syscalls += 1
        window = self.windows.get(call.tid)
        if call.name in RENAME_CALLS or call.name in ("link", "linkat"):
            self._rename(call, window)
            return
        if not call.ok:
            return
        if call.name in ("open", "openat", "openat2", "creat"):
            self._open(call)
        elif call.name == "close":
            self.fds.pop(_int(call.args[0]), None)
        elif call.name in ("dup", "dup2", "dup3", "fcntl"):
            self._dup(call)
        elif call.name in ("write", "pwrite64"):
            self._write(call)
        elif call.name in SYNC_CALLS:
            self._sync(call, window)
        elif call.name in ("mkdir", "mkdirat", "unlink", "unlinkat", "rmdir"):
            self._namespace(call)
        elif call.name in ("chdir", "fchdir"):
            self.cwd = self._at_path(call) or self.cwd
        elif call.name in _DATA_CALLS | _NAME_CALLS | {"syncfs", "sync"}:
            self._unmodelled(call)

    def _boundary(self, tid: int, phase: str, index: int) -> None:
        call = self.outcome.calls[index]
        if phase == "begin":
            self.model = self.outcome.models.get(index, self.model)
            self.windows[tid] = _Window(call, self._expected(call))
            return
        window = self.windows.pop(tid, None)
        if call.name in ("create", "create_with_layout") and call.error is None:
            inode = self._inode_at(str(call.args[0]))
            if inode is not None:
                self.created[call.result] = inode
        if window is not None and self.diverged is None:
            self._judge(window, call)

    # -- (a) durability calls ------------------------------------------------------------

    def _expected(self, call: DriverCall) -> int | None:
        if call.name == "fsync":
            return self.created.get(call.args[0])
        if call.name == "fsync_dir":
            return self._inode_at(str(call.args[0]))
        return None

    def _judge(self, window: _Window, call: DriverCall) -> None:
        if call.error is not None or call.name not in ("fsync", "fsync_dir", "rename_noreplace"):
            return  # a failed call promises nothing
        if call.name == "rename_noreplace":
            self.result.durability_calls += 1
            self._judge_rename(window, call)
            return
        if window.expected is None:
            return  # the handle's file is not known: nothing to hold the call to
        self.result.durability_calls += 1
        if any(inode == window.expected for inode, _ in window.syncs):
            self.result.matched += 1
            return
        made = "; ".join(what for _, what in window.syncs)
        target = self._describe(window.expected)
        kind = "entries" if call.name == "fsync_dir" else "data"
        asked = f"the kernel was asked to sync {made} instead" if made else (
            "no fsync or fdatasync system call reached the kernel"
        )  # fmt: skip
        self.result.fail(
            f"syscall trace: driver call {call}",
            "I2",
            f"{call.name} of {target}: {asked}, so its {kind} may be lost at a power loss "
            f"after the strategy counted it durable",
        )

    def _judge_rename(self, window: _Window, call: DriverCall) -> None:
        if any(_noreplace(sc) and sc.error not in _REFUSED for sc, _ in window.renames):
            self.result.matched += 1
            return
        plain = [
            (sc, is_dir)
            for sc, is_dir in window.renames
            if sc.name in RENAME_CALLS and not _noreplace(sc)
        ]
        if plain and self.noreplace_refused and all(is_dir for _, is_dir in plain):
            self.result.matched += 1  # the driver's documented fallback (posix.py)
            self.fallbacks += 1
            return
        made = "; ".join(str(sc) for sc, _ in plain) or "no rename system call"
        self.result.fail(
            f"syscall trace: driver call {call}",
            "I5",
            f"the no-replace rename reached the kernel as {made}, not as "
            f"renameat2(RENAME_NOREPLACE): a plain rename(2) replaces an existing target, so a "
            f"racing writer's published step can be overwritten",
        )

    # -- the system calls ----------------------------------------------------------------

    def _open(self, call: Syscall) -> None:
        if call.name == "creat":
            path, flags = self._resolve("AT_FDCWD", call.args[0]), "O_CREAT|O_TRUNC"
        elif call.name == "open":
            path, flags = self._resolve("AT_FDCWD", call.args[0]), call.args[1]
        else:
            path, flags = self._resolve(call.args[0], call.args[1]), call.args[2]
        if path is None:
            return
        handle = None
        relative = self._relative(path)
        if relative is not None and self.diverged is None:
            self.result.store_syscalls += 1
            handle = self._sim(call, lambda: self._open_sim(relative, flags))
        self.fds[call.result or 0] = _Fd(path, handle)

    def _open_sim(self, relative: str, flags: str) -> int:
        inode = self._inode_at(relative)
        if inode is None and "O_CREAT" in flags:
            return self.sim.create(relative)
        handle = self.sim.open_existing(relative)
        if "O_TRUNC" in flags and self.sim.size_of(self.sim.inode_of(handle)):
            self.stopped_cuts = self.stopped_cuts or f"{relative} truncated by open (O_TRUNC)"
        return handle

    def _dup(self, call: Syscall) -> None:
        if call.name == "fcntl" and "F_DUPFD" not in call.args[1]:
            return
        entry = self.fds.get(_int(call.args[0]))
        if entry is not None and call.result is not None:
            self.fds[call.result] = entry

    def _write(self, call: Syscall) -> None:
        entry = self.fds.get(_int(call.args[0]))
        if entry is None or entry.handle is None or self.diverged:
            return
        self.result.store_syscalls += 1
        decoded = decode_string(call.args[1])
        written = call.result or 0
        inode = self.sim.inode_of(entry.handle)
        if decoded is None or len(decoded[0]) < written:
            self._stop_cuts(f"a write of {written} bytes longer than the trace shows ({call})")
            return
        if call.name == "pwrite64" and _int(call.args[3]) != self.sim.size_of(inode):
            self._stop_cuts(f"a write at an offset other than the end ({call})")
            return
        self.sim.write(entry.handle, decoded[0][:written])

    def _sync(self, call: Syscall, window: _Window | None) -> None:
        entry = self.fds.get(_int(call.args[0]))
        handle = entry.handle if entry is not None else None
        inode = self.sim.inode_of(handle) if handle is not None else None
        if window is not None:
            what = self._describe(inode) if inode is not None else (
                entry.path if entry is not None else f"descriptor {call.args[0]}"
            )  # fmt: skip
            window.syncs.append((inode, f"{call.name}({what})"))
        if handle is not None and self.diverged is None:
            self.result.store_syscalls += 1
            self.cut(self._where(call))
            self.sim.fsync(handle)

    def _rename(self, call: Syscall, window: _Window | None) -> None:
        if call.name == "rename" or call.name == "link":
            source = self._resolve("AT_FDCWD", call.args[0])
            target = self._resolve("AT_FDCWD", call.args[1])
        else:
            source = self._resolve(call.args[0], call.args[1])
            target = self._resolve(call.args[2], call.args[3])
        if _noreplace(call) and call.error in _REFUSED:
            self.noreplace_refused = True
        src = self._relative(source) if source else None
        dst = self._relative(target) if target else None
        if src is None and dst is None:
            return
        self.result.store_syscalls += 1
        moving = self._inode_at(src) if src is not None else None
        if window is not None:
            window.renames.append((call, moving is not None and self.sim.is_dir(moving)))
        if not call.ok or self.diverged:
            return
        if src is None or dst is None or call.name in ("link", "linkat"):
            self._diverge(f"{call}: a name in or out of the store, or a hard link, not modelled")
            return
        if call.name == "renameat2" and "RENAME_EXCHANGE" in call.args[4]:
            self._diverge(f"{call}: RENAME_EXCHANGE is not modelled")
            return
        self.cut(self._where(call))
        rename = self.sim.rename_noreplace if _noreplace(call) else self.sim.rename_replace
        self._sim(call, lambda: rename(src, dst))

    def _namespace(self, call: Syscall) -> None:
        at = call.name.endswith("at")
        path = self._resolve(call.args[0] if at else "AT_FDCWD", call.args[1 if at else 0])
        relative = self._relative(path) if path else None
        if relative is None or self.diverged:
            return
        self.result.store_syscalls += 1
        if call.name.startswith("mkdir"):
            self._sim(call, lambda: self.sim.mkdir(relative))
        elif call.name == "rmdir" or (call.name == "unlinkat" and "AT_REMOVEDIR" in call.args[2]):
            self._sim(call, lambda: self.sim.rmdir(relative))
        else:
            self._sim(call, lambda: self.sim.unlink(relative))

    def _unmodelled(self, call: Syscall) -> None:
        on_store = any(
            (path := self._resolve("AT_FDCWD", arg)) is not None
            and self._relative(path) is not None
            for arg in call.args
            if arg.startswith('"')
        ) or (call.args and self._store_fd(call.args[0]))
        if not on_store:
            return
        if call.name in ("ftruncate", "truncate") and call.args[-1] == "0":
            return  # truncating a new file to nothing changes nothing
        self._stop_cuts(f"{call} is not modelled")

    # -- power loss (b) ------------------------------------------------------------------

    def cut(self, where: str) -> None:
        """Check every state a power loss at this instant may leave."""
        if self.diverged or self.stopped_cuts:
            return
        self.result.cuts += 1
        for state in self.sim.crash_states(depth=self.depth):
            self.result.states += 1
            if len(self.result.failures) >= MAX_FAILURES:
                continue
            survivor = Store(
                self.strategy.with_driver(self.sim.materialise(state)), clock=self.clock
            )
            case = f"syscall trace: power loss before {where}: {state.describe()}"
            try:
                check_invariants(survivor, pickle.loads(self.model), lost_blame="I2")
            except InvariantViolation as violation:
                self.result.fail(case, violation.invariant, violation.detail)
            except CkptStoreError as exc:
                self.result.fail(case, "I1", f"store unreadable: {exc!r}")

    # -- helpers -------------------------------------------------------------------------

    def _where(self, call: Syscall) -> str:
        window = self.windows.get(call.tid)
        inside = f" in driver call {window.call}" if window else " (outside any driver call)"
        return f"system call #{call.number} {call}{inside}"

    def _sim(self, call: Syscall, effect: Any) -> Any:
        try:
            return effect()
        except CkptStoreError as exc:
            self._diverge(f"{call} succeeded on the real file system, not in the model ({exc})")
            return None

    def _diverge(self, why: str) -> None:
        self.diverged = self.diverged or why

    def _stop_cuts(self, why: str) -> None:
        self.stopped_cuts = self.stopped_cuts or why

    def _resolve(self, dirfd: str, path_arg: str) -> str | None:
        decoded = decode_string(path_arg)
        if decoded is None:
            return None
        path = os.fsdecode(decoded[0])
        if not path.startswith("/"):
            base = self.cwd if dirfd == "AT_FDCWD" else self._fd_path(dirfd)
            if base is None:
                return None
            path = f"{base}/{path}"
        return os.path.normpath(path)

    def _at_path(self, call: Syscall) -> str | None:
        if call.name == "fchdir":
            return self._fd_path(call.args[0])
        return self._resolve("AT_FDCWD", call.args[0])

    def _fd_path(self, fd_arg: str) -> str | None:
        entry = self.fds.get(_int(fd_arg))
        if entry is None:
            return None
        if entry.handle is not None:
            relative = self.sim.path_of(self.sim.inode_of(entry.handle))
            if relative is not None:
                return os.path.join(self.root, relative) if relative else self.root
        return entry.path

    def _store_fd(self, fd_arg: str) -> bool:
        entry = self.fds.get(_int(fd_arg))
        return entry is not None and entry.handle is not None

    def _relative(self, path: str) -> str | None:
        if path == self.root:
            return ""
        if path.startswith(self.root + "/"):
            return path[len(self.root) + 1 :]
        return None

    def _inode_at(self, relative: str) -> int | None:
        try:
            return self.sim.inode_at(relative)
        except CkptStoreError:
            return None

    def _describe(self, inode: int) -> str:
        path = self.sim.path_of(inode)
        shown = "(the store's root)" if path == "" else (path or f"inode {inode} (unlinked)")
        return f"{shown} (a directory)" if self.sim.is_dir(inode) else shown


def _marker(call: Syscall) -> tuple[str, int] | None:
    if call.name != "write" or len(call.args) < 2 or MARK.hex()[:8] not in _hex_head(call):
        return None
    decoded = decode_string(call.args[1])
    if decoded is None or not decoded[0].startswith(MARK):
        return None
    phase, _, index = decoded[0][len(MARK) :].decode().strip().partition(" ")
    return phase, int(index)


def _hex_head(call: Syscall) -> str:
    """The first bytes of a written buffer as hex, to skip most writes without decoding."""
    return call.args[1][:48].replace("\\x", "")


def _noreplace(call: Syscall) -> bool:
    return call.name == "renameat2" and len(call.args) > 4 and "RENAME_NOREPLACE" in call.args[4]


def _int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        return -1
