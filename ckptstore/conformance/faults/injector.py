"""Fault injection under any driver: count its calls, crash at any one, fail transiently.

``FaultInjector`` wraps a file-system or object-store driver and numbers every primitive call.
It can simulate the death of the process *before* call k (the call never reaches storage) or
*after* call k (storage did it; the caller died before it learned so), and it can make chosen
calls fail with a transient error, before or after they took effect. After a crash every later
call fails too: a dead process touches nothing, not even in its ``finally`` blocks.

Every call the driver's protocols declare is numbered, an optional one included: a
``CloningDriver``'s ``clone`` is crashed before (the new shard file stays empty) and after (it
holds the source's bytes, in the page cache: a dead process does not lose them, a power loss
may, until the file's fsync; the power-loss layer's ``models.simfs`` models that).
"""

from __future__ import annotations

import enum
import errno
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptstore.driver import PutMode, driver_family, storage_calls
from ckptstore.errors import IndeterminateOutcomeError, TransientStorageError

__all__ = [
    "READ_CALLS",
    "READ_ONLY_CALLS",
    "CallRecord",
    "CrashMode",
    "FaultInjector",
    "FaultPlan",
    "InjectedFault",
    "InjectedTimeoutError",
    "InjectedTransientError",
    "SimulatedCrash",
]

_LAZY_RESULTS = frozenset({"list", "list_versions", "list_multipart_uploads"})
_UPLOAD_CALLS = frozenset({"create_multipart", "complete_multipart", "abort_multipart"})
_KEYED_BY_UPLOAD = frozenset({"upload_part", "complete_multipart", "abort_multipart"})
"""Calls whose second argument is an upload's id, not a name."""
_FROM_OUTSIDE = frozenset({"clone"})
"""Calls whose second argument is a descriptor of a file outside the storage (a clone's
source, the trainer's file), not a name: its number may be one a closed handle had."""
READ_ONLY_CALLS = frozenset(
    {
        "stat",
        "listdir",
        "open_read",
        "read_range",
        "get",
        "head",
        "list",
        "list_versions",
        "list_multipart_uploads",
        "check_bucket",
        "bucket_versioning",
        "upload_progress",
    }
)
"""Driver calls that only read (file-system and object-store protocols): a crash before one
leaves the storage as a crash before the next call does."""

READ_CALLS = frozenset(
    {
        "get", "head", "list", "list_versions", "list_multipart_uploads", "bucket_versioning",
        "check_bucket", "upload_progress", "open_read", "read_range", "listdir", "stat", "close",
        "fsync", "fsync_dir", "start_writeback",
    }
)  # fmt: skip
"""Calls that never change what the storage holds (any other call may)."""

_CONDITIONS = {"create": "If-None-Match", "update": "If-Match"}


class SimulatedCrash(BaseException):
    """The process died here. A BaseException, so that ``except Exception`` cannot survive it.

    ``record`` and ``mode``: the call the process died at, and whether before or after it
    (None for a call made after the death). ``previous``: for a death before a call made when
    no other call was in flight, the call made just before it, which had returned: the storage
    is left as by a death just after that call.
    """

    def __init__(
        self,
        message: str,
        record: CallRecord | None = None,
        mode: CrashMode | None = None,
        previous: CallRecord | None = None,
    ) -> None:
        super().__init__(message)
        self.record = record
        self.mode = mode
        self.previous = previous


class InjectedFault:
    """Marks an error the injector made up: never taken for a failure of the storage itself."""


class InjectedTransientError(InjectedFault, TransientStorageError):
    """An injected transient failure (a 503): the call did not reach storage."""


class InjectedTimeoutError(InjectedFault, IndeterminateOutcomeError):
    """An injected timeout after the call took effect."""


class CrashMode(enum.Enum):
    """Where, relative to the storage call, the process dies or the call fails."""

    BEFORE = "before"
    """The call never reaches storage."""
    AFTER = "after"
    """Storage performed the call; the caller never learned so."""


@dataclass
class FaultPlan:
    """Which call (counting from 0) crashes, and which calls fail transiently, and how."""

    crash_at: int | None = None
    crash_mode: CrashMode = CrashMode.BEFORE
    crash_on: str | None = None
    """Crash at the first call of this name (``complete_multipart``), if ``crash_at`` is None."""
    transient: dict[int, CrashMode] = field(default_factory=dict)
    transient_calls: frozenset[str] | None = None
    """Restrict transient faults to these call names (None: any call)."""
    observe: Callable[[], object] | None = None
    """Called before every call; its answer is kept as the call's ``context`` (what else, not
    the storage, a crash before this call would leave: the model's state, the clock)."""


@dataclass(frozen=True)
class CallRecord:
    """One primitive call as the injector saw it."""

    index: int
    name: str
    args: tuple[str, ...]
    conditional: bool = False
    """A conditional write (If-None-Match / If-Match): a commit point on object stores."""
    condition: str = ""
    """Its header: ``If-None-Match`` (create) or ``If-Match`` (compare-and-swap)."""
    context: object = None
    """What ``FaultPlan.observe`` answered before this call (None: nothing observed)."""

    @property
    def reads_only(self) -> bool:
        """The call only reads: storage holds the same before and after it."""
        return self.name in READ_ONLY_CALLS

    def __str__(self) -> str:
        return f"#{self.index} {self.name}({', '.join(self.args)})"


class FaultInjector:
    """A driver that forwards to ``inner`` and injects the faults of a ``FaultPlan``."""

    def __init__(
        self,
        inner: Any,
        plan: FaultPlan | None = None,
        on_change: Callable[[tuple[str, ...] | None], None] | None = None,
        on_upload: Callable[[str, tuple[Any, ...], Any], None] | None = None,
    ) -> None:
        self._inner = inner
        self.on_change = on_change
        """Called before each call that may change what the storage holds, with the names it
        may change (None: not known)."""
        self.on_upload = on_upload
        """Called with the name, arguments and result of each ``create_multipart``,
        ``complete_multipart`` and ``abort_multipart`` the storage carried out (the leftover
        audit's second route to the uploads a crash left)."""
        self._paths: dict[int, str] = {}
        self.on_death: Callable[[SimulatedCrash], None] | None = None
        """Called when the process dies at one of this driver's calls: a process that uses
        two stores (a tiered store) dies for both (``FaultInjector.kill`` the other)."""
        self.plan = plan or FaultPlan()
        self.calls: list[CallRecord] = []
        self.crashed = False
        self._crash_at = self.plan.crash_at
        self.death: SimulatedCrash | None = None
        """The crash the process died of (its call, mode and preceding call)."""
        self.transient_injected: list[CallRecord] = []
        self._handles: set[int] = set()
        self._calls = storage_calls(inner)
        self.family = driver_family(inner)
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self.overlapped = False
        """Whether a call started while another was still running (a concurrent workload)."""

    @property
    def inner(self) -> Any:
        """The wrapped driver."""
        return self._inner

    @property
    def count(self) -> int:
        """How many primitive calls were made (the next call's index)."""
        return len(self.calls)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in self._calls:
            return attribute
        return self._wrap(name, attribute)

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.crashed:
                death = self.death  # where it died, whichever later call notices it
                raise SimulatedCrash(
                    f"{name} called after the process died",
                    *((death.record, death.mode, death.previous) if death else ()),
                )
            mode = kwargs.get("mode")
            conditional = isinstance(mode, PutMode) and mode.conditional
            context = self.plan.observe() if self.plan.observe is not None else None
            condition = _CONDITIONS.get(mode.kind, "") if isinstance(mode, PutMode) else ""
            record = CallRecord(
                len(self.calls),
                name,
                tuple(_short(a) for a in args),
                conditional,
                condition=condition,
                context=context,
            )
            self.calls.append(record)
            if self.on_change is not None and name not in READ_CALLS:
                self.on_change(self._names(name, args))
            plan = self.plan
            if self._crash_at is None and plan.crash_on == name:
                self._crash_at = record.index
            if self._crash_at == record.index and plan.crash_mode is CrashMode.BEFORE:
                with self._in_flight_lock:
                    idle = self._in_flight == 0
                previous = self.calls[-2] if idle and len(self.calls) > 1 else None
                self._die(record, CrashMode.BEFORE, previous)
            transient = plan.transient.get(record.index)
            if transient is not None and (
                plan.transient_calls is None or name in plan.transient_calls
            ):
                self.transient_injected.append(record)
                if transient is CrashMode.BEFORE:
                    raise InjectedTransientError(
                        f"injected transient fault at {name}", http_status=503
                    )
            dies_after = self._crash_at == record.index and plan.crash_mode is CrashMode.AFTER
            try:
                result = self._forward(name, method, args, kwargs)
            except Exception:
                if dies_after:  # the process dies whatever the storage answered
                    self._die(record, CrashMode.AFTER)
                raise
            if self.on_upload is not None and name in _UPLOAD_CALLS:
                self.on_upload(name, args, result)
            if name in ("create", "create_with_layout"):
                self._handles.add(result)
                if args and isinstance(args[0], str):
                    self._paths[result] = args[0]
            elif name == "close" and args:
                self._handles.discard(args[0])
            fails_after = transient is CrashMode.AFTER and (
                plan.transient_calls is None or name in plan.transient_calls
            )
            if (dies_after or fails_after) and name == "open_read":
                result.close()  # the caller never gets the stream it opened
            if dies_after:
                self._die(record, CrashMode.AFTER)
            if fails_after:
                raise InjectedTimeoutError(
                    errno.ETIMEDOUT, f"injected timeout after {name} took effect"
                )
            return result

        return call

    def _names(self, call: str, args: tuple[Any, ...]) -> tuple[str, ...] | None:
        """The names a changing ``call`` with ``args`` may change: its leading string arguments
        (a key, a path, a rename's two paths; an upload's key, not its id), or a handle's path;
        None if not known."""
        names = []
        for arg in args[: 1 if call in _KEYED_BY_UPLOAD | _FROM_OUTSIDE else 2]:
            if isinstance(arg, str):
                names.append(arg)
            elif isinstance(arg, int) and arg in self._paths:
                names.append(self._paths[arg])
            else:
                break
        return tuple(names) or None

    def _forward(
        self, name: str, method: Callable[..., Any], args: Any, kwargs: dict[str, Any]
    ) -> Any:
        with self._in_flight_lock:
            self._in_flight += 1
            self.overlapped |= self._in_flight > 1
        try:
            result = method(*args, **kwargs)
            return _Materialised(list(result)) if name in _LAZY_RESULTS else result
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1

    def _die(self, record: CallRecord, mode: CrashMode, previous: CallRecord | None = None) -> None:
        death = SimulatedCrash(f"crash at call {record}", record, mode, previous)
        self.kill(death)
        raise death

    def kill(self, death: SimulatedCrash) -> None:
        """The process died of ``death`` (here, or at a call of another driver it used): every
        later call fails, and the descriptors it held are closed. ``on_death`` hears of it."""
        if self.crashed:
            return
        self.crashed = True
        for handle in list(self._handles):  # the kernel closes a dead process's descriptors
            try:
                self._inner.close(handle)
            except OSError:
                pass
        self._handles.clear()
        self.death = death
        if self.on_death is not None:
            self.on_death(death)


class _Materialised(Iterator[Any]):
    """A listing read completely at call time, so that one call is one storage round."""

    def __init__(self, items: list[Any]) -> None:
        self._iter = iter(items)

    def __next__(self) -> Any:
        return next(self._iter)


def _short(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(memoryview(value))} bytes>"
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
