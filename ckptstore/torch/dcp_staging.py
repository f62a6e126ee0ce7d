"""Staging for ``dcp.async_save``: a copy of the state the trainer may change at once, into
host memory reused from save to save but never while a save still writes from it.

DCP calls ``stage`` on the trainer's thread (the time the trainer is blocked) and then saves
the staged copy on a thread of its own. torch's own stagers reuse one cached copy per stager,
so two saves in flight from one stager would write each other's bytes; here each staging takes
a set of buffers no unfinished save holds (a new one while the previous save still runs),
and a set returns to the pool when DCP lets go of the staged tensors. How long each staging
took is kept by the staged tensors' memory, so the save that writes them can record it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

__all__ = ["ReusingStager"]


_OPTIONS = StagingOptions(
    use_pinned_memory=torch.cuda.is_available(),
    use_shared_memory=False,
    use_async_staging=False,  # the copy happens in ``stage``: that is what the trainer waits for
    use_non_blocking_copy=False,
)


def _tensors(state: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(state) if isinstance(leaf, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> int:
    """The address of the memory a (local) tensor lives in; 0 for an empty one."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.untyped_storage().data_ptr())


class _Countdown:
    """Calls ``done`` once every object it watches is gone."""

    def __init__(self, watched: list[Any], done: Callable[[], None]) -> None:
        self._left = len(watched)
        self._done = done
        self._lock = threading.RLock()
        for item in watched:
            weakref.finalize(item, self._one_gone)

    def _one_gone(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done()


class ReusingStager:
    """Stages state dicts into reused host memory, one buffer set per save in flight."""

    def __init__(self) -> None:
        # Re-entrant: a garbage collection inside a locked section may finalise an earlier
        # staging, whose release takes the lock again on the same thread.
        self._lock = threading.RLock()
        self._free: list[DefaultStager] = []
        self._seconds: dict[int, float] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in host memory no save in flight holds; timed.

        The buffers return to the pool once every staged tensor is gone (DCP drops them when
        the save that writes them ends); a staging whose tensors are all inside other objects
        (which cannot be watched) never returns to the pool."""
        started = time.perf_counter()
        with self._lock:
            stager = self._free.pop() if self._free else None
        if stager is None:
            stager = DefaultStager(_OPTIONS)
        staged = cast(dict[str, Any], stager.stage(state_dict))
        seconds = time.perf_counter() - started
        tensors = _tensors(staged)
        storages = {_storage(tensor) for tensor in tensors} - {0}  # empty tensors: no memory
        with self._lock:
            for storage in storages:
                self._seconds[storage] = seconds
        if tensors:
            _Countdown(tensors, lambda: self._release(stager, storages))
        # else: nothing to watch (tensors only inside other objects): this set is never reused
        return staged

    def _release(self, stager: DefaultStager, storages: set[int]) -> None:
        with self._lock:
            for storage in storages:
                self._seconds.pop(storage, None)
            if not self._free:  # keep one set for the next save; more were for overlaps
                self._free.append(stager)
                return
        stager.close()

    def seconds_for(self, tensor: torch.Tensor) -> float | None:
        """How long the staging that made ``tensor`` (or a view of it) took; None if none did."""
        storage = _storage(tensor)  # outside the lock: it may allocate, and so collect
        with self._lock:
            return self._seconds.get(storage) if storage else None

    def close(self) -> None:
        """Free the buffers kept for the next save."""
        with self._lock:
            free, self._free = self._free, []
        for stager in free:
            stager.close()
