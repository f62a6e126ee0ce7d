"""Clients shared by the stores opened with the same options, their connections held only while
some store is open.

Making an SDK client costs (a boto3 client: half a second of CPU), and one client's connection
pool serves every thread: stores opened with the same options share one. Each store holds a
lease on it; when the last lease is released (the last such store closed), the client's
connections are closed. The client itself is kept for the next store with those options (it
opens connections again as they are needed): what a process keeps is one client per distinct
set of options, never one per store. No secret is kept as a cache key: a credential is keyed
by a keyed hash of it (a credential object by its identity).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["ClientCache", "ClientLease"]

C = TypeVar("C")
CacheKey = tuple[tuple[str, str], ...]


@dataclass
class _Entry(Generic[C]):
    client: C
    leases: int = 0


@dataclass
class ClientLease(Generic[C]):
    """One store's hold on a shared client; ``release`` (once, then harmless) lets it go."""

    client: C
    _release: Callable[[], None] = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """Let go of the client: the last lease released closes its connections."""
        if not self._released:
            self._released = True
            self._release()


class ClientCache(Generic[C]):
    """Clients by the options that make them (``options``: the names that matter; ``secret``:
    those never kept as they are); ``disconnect`` closes a client's connections."""

    def __init__(
        self,
        options: Collection[str],
        secret: Collection[str],
        disconnect: Callable[[C], None],
        *,
        environment: Collection[str] = (),
    ) -> None:
        """``environment``: the variables the client is made from when no option says
        otherwise (a credential, an account, an emulator's address): part of the key, so a
        process whose environment changes (another account, a rotated key) never gets a
        client made from the old one; those named in ``secret`` are hashed."""
        self._options = frozenset(options)
        self._environment = tuple(sorted(environment))
        self._secret = frozenset(secret)
        self._disconnect = disconnect
        self._lock = threading.Lock()
        self._entries: dict[CacheKey, _Entry[C]] = {}
        self._fingerprint_key = secrets.token_bytes(32)

    def __iter__(self) -> Iterator[CacheKey]:
        with self._lock:
            return iter(list(self._entries))

    def key(self, options: Mapping[str, object]) -> CacheKey:
        """The cache key of ``options`` and the environment: the client's options and
        environment variables, each secret one hashed."""
        given = [
            (k, self._fingerprint(k, v)) for k, v in options.items() if k in self._options and v
        ]
        found = [
            (f"${name}", self._fingerprint(name, os.environ[name]))
            for name in self._environment
            if os.environ.get(name)
        ]
        return tuple(sorted(given + found))

    def _fingerprint(self, option: str, value: object) -> str:
        if option not in self._secret:
            return str(value)
        if not isinstance(value, str):  # a credential object: itself, never its contents
            return f"object:{id(value)}"
        return hmac.new(self._fingerprint_key, value.encode(), hashlib.sha256).hexdigest()

    def get(self, options: Mapping[str, object], make: Callable[[], C]) -> C:
        """The shared client of ``options`` (made on first use), held for the process."""
        with self._lock:
            return self._entry(options, make).client

    def lease(self, options: Mapping[str, object], make: Callable[[], C]) -> ClientLease[C]:
        """The shared client of ``options``, held until the lease is released."""
        key = self.key(options)
        with self._lock:
            entry = self._entry(options, make)
            entry.leases += 1
        return ClientLease(entry.client, lambda: self._release(key, entry))

    def _entry(self, options: Mapping[str, object], make: Callable[[], C]) -> _Entry[C]:
        key = self.key(options)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(make())
        return entry

    def _release(self, key: CacheKey, entry: _Entry[C]) -> None:
        with self._lock:  # held: a store opening now waits, then finds the client idle
            entry.leases -= 1
            if entry.leases == 0 and self._entries.get(key) is entry:
                self._disconnect(entry.client)

    def close(self) -> None:
        """Close every client's connections and forget the clients (the next store makes its
        own): for a process that wants all of it back, and for tests."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            self._disconnect(entry.client)
