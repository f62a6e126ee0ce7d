"""A fast store for saving and a durable one for keeping, as one store a trainer uses.

``ckptstore.open(url, replicate_to=durable_url)`` returns a ``TieredStore``: every save is
published in the fast store (node-local NVMe, tmpfs) with that store's protocol, so the trainer
waits only for it; a ``Replicator`` thread copies published checkpoints to the durable store
(S3, GCS, a parallel file system) as its policy says, and publishes each there with the
durable store's protocol. Readers answer across both: ``latest()`` is the newest checkpoint
published and complete in either, read from the fast copy where both hold it, so a job
restarted on a new node (an empty fast store) resumes from the durable one. Each tier has its
own retention; the fast tier's never removes a checkpoint still owed to the durable tier.
The protocol and its guarantees: docs/protocol.md, "Tiers"; the user's page: docs/tiers.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, overload

from ckptstore.checkpoint import Checkpoint
from ckptstore.commit.base import GcReport
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    InvalidInputError,
    InvalidOptionError,
    ReplicationError,
)
from ckptstore.lineage import Epoch
from ckptstore.pending import PendingCheckpoint, ShardData
from ckptstore.replication import KeepOwed, ReplicationPolicy, Replicator, replication_policy
from ckptstore.retention import RetentionPolicy
from ckptstore.store import DEFAULT_GRACE, Clock, Store, open_store
from ckptstore.urls import parse_url

__all__ = ["TieredGcReport", "TieredStore", "open_checkpoints", "open_tiered"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TieredGcReport:
    """What GC removed in each tier."""

    fast: GcReport
    durable: GcReport


class TieredStore:
    """Checkpoints saved to a fast store and copied to a durable one; read from either.

    Built by ``ckptstore.open(url, replicate_to=...)``. ``fast`` and ``durable`` are the
    trainer's Stores of the two tiers (the durable one only reads here); the ``replicator``
    has Stores of its own. ``fast``'s retention is wrapped so that it keeps what the
    replicator still owes the durable tier.
    """

    def __init__(
        self, fast: Store, durable: Store, replicator: Replicator, *, background: bool = True
    ) -> None:
        self.fast = fast
        self.durable = durable
        self.replicator = replicator
        if fast.retention is not None:
            fast.retention = KeepOwed(fast.retention, replicator)
        fast.on_publish(replicator.notify)
        self._closed = False
        if background:
            replicator.start()

    @property
    def url(self) -> str:
        """The fast store's URL (where saves go)."""
        return self.fast.url

    @property
    def durable_url(self) -> str:
        """The durable store's URL."""
        return self.durable.url

    def __repr__(self) -> str:
        return f"<TieredStore {self.url} -> {self.durable_url} ({self.replicator.policy!r})>"

    # -- writing: the fast tier ----------------------------------------------------------

    def begin(
        self,
        step: int,
        metadata: Mapping[str, object] | None = None,
        *,
        expected_shards: Iterable[str] | None = None,
        world_size: int = 1,
        attempt: str | None = None,
    ) -> PendingCheckpoint:
        """Start saving ``step`` in the fast store (``Store.begin``); once it publishes there,
        the replicator is told."""
        return self.fast.begin(
            step, metadata, expected_shards=expected_shards, world_size=world_size, attempt=attempt
        )

    def join(self, step: int, attempt: str) -> PendingCheckpoint:
        """Write shards into a coordinator's attempt in the fast store (``Store.join``)."""
        return self.fast.join(step, attempt)

    def save(
        self,
        step: int,
        shards: Mapping[str, ShardData],
        metadata: Mapping[str, object] | None = None,
    ) -> Checkpoint:
        """Write every shard and publish in the fast store; the durable copy follows."""
        return self.fast.save(step, shards, metadata)

    # -- reading: either tier ------------------------------------------------------------

    def latest(self, *, verified: bool = False) -> Checkpoint | None:
        """The newest checkpoint published and complete in either tier, or None.

        Where both hold it, the fast copy is returned. A damaged newest checkpoint in the
        fast tier (an IntegrityError without ``verified``) is answered by the durable copy of
        that step or a newer one; without one, the error is raised, as ``Store.latest`` does.
        """
        damaged: IntegrityError | None = None
        try:
            fast = self.fast.latest(verified=verified)
        except IntegrityError as exc:
            fast, damaged = None, exc
        durable = self.durable.latest(verified=verified)
        if damaged is not None:
            listed = self.fast.named_steps()  # the damaged one among them
            if durable is None or (listed and durable.step < listed[-1]):
                raise damaged
            return durable
        if fast is None or (durable is not None and durable.step > fast.step):
            return durable
        return fast

    def take_over(self, resumed_from: int | None, *, note: str = "") -> tuple[Epoch, Epoch]:
        """Take both tiers over for this run (``Store.take_over``), resumed from the same
        step: a zombie of an earlier run can then no longer publish into either history, nor
        its replicator into the durable one. Returns the fast and the durable epoch."""
        fast = self.fast.take_over(resumed_from, note=note)
        durable = self.replicator.durable.take_over(resumed_from, note=note)
        return fast, durable

    def get(self, step: int) -> Checkpoint:
        """The checkpoint at ``step``: the fast copy, else the durable one (``Store.get``)."""
        try:
            return self.fast.get(step)
        except (CheckpointNotFoundError, IntegrityError) as fast_error:
            try:
                return self.durable.get(step)
            except CheckpointNotFoundError:
                raise fast_error from None

    def steps(self) -> list[int]:
        """Every step published in either tier, ascending."""
        return sorted(set(self.fast.steps()) | set(self.durable.steps()))

    def checkpoints(self) -> list[Checkpoint]:
        """Every complete checkpoint of either tier, ascending, the fast copy where both hold
        one."""
        found = {checkpoint.step: checkpoint for checkpoint in self.durable.checkpoints()}
        found.update((checkpoint.step, checkpoint) for checkpoint in self.fast.checkpoints())
        return [found[step] for step in sorted(found)]

    # -- replication ---------------------------------------------------------------------

    def wait_replicated(self, timeout: float | None = None, *, newest: bool = False) -> None:
        """Block until the durable tier holds every checkpoint the policy selects among those
        published in the fast tier before this call (and the newest, if ``newest``).

        Raises ReplicationError if a pass that started after this call failed (the durable
        store unreachable, a copy that did not match), ReplicationTimeoutError after
        ``timeout`` seconds. Nothing is lost either way: what is not copied is owed.
        """
        self.replicator.wait(timeout, newest=newest)

    # -- removal -------------------------------------------------------------------------

    def apply_retention(self, policy: RetentionPolicy | None = None) -> list[int]:
        """Apply ``policy`` to both tiers (default: each tier's own); return the steps removed
        from either, ascending. In the fast tier, what the durable tier is still owed is kept."""
        fast_policy = None if policy is None else KeepOwed(policy, self.replicator)
        removed = set(self.fast.apply_retention(fast_policy))
        durable_policy = policy or self.replicator.durable.retention
        if durable_policy is not None:
            removed |= set(self.replicator.durable.apply_retention(durable_policy))
        return sorted(removed)

    def gc(
        self, *, grace: timedelta | float = DEFAULT_GRACE, dry_run: bool = False
    ) -> TieredGcReport:
        """Collect dead attempts' leftovers in both tiers (``Store.gc``), copies the
        replicator abandoned included."""
        return TieredGcReport(
            fast=self.fast.gc(grace=grace, dry_run=dry_run),
            durable=self.durable.gc(grace=grace, dry_run=dry_run),
        )

    # -- lifetime ------------------------------------------------------------------------

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stop the replicator and release both tiers' stores; never loses a checkpoint.

        With ``wait`` (the default) it first waits, up to ``timeout`` seconds, until the
        durable tier holds what is owed and the newest checkpoint of the fast tier: a run
        that ends normally leaves its last checkpoint durable. Without, or when that fails,
        a copy in progress is abandoned (its staging is removed, or left to the durable
        store's GC): what is not yet durable stays in the fast tier, owed to the next
        replicator opened on the pair. Raises that failure (ReplicationError) after closing.
        """
        if self._closed:
            return
        error: ReplicationError | None = None
        if wait:
            try:
                self.wait_replicated(timeout, newest=True)
            except ReplicationError as exc:
                error = exc
        self.replicator.stop()
        self._closed = True
        for store in {id(s): s for s in self._stores()}.values():
            store.close()
        if error is not None:
            raise error

    def _stores(self) -> list[Store]:
        replicator = self.replicator
        return [self.fast, self.durable, replicator.fast, replicator.durable]

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's own exception is what the caller must see
            self.close()
        except ReplicationError as error:
            log.warning("%s: closing after an error: %s", self, error)


@overload
def open_checkpoints(
    url: str,
    *,
    replicate_to: None = None,
    create: bool = True,
    retention: RetentionPolicy | None = None,
    clock: Clock | None = None,
    **options: object,
) -> Store: ...


@overload
def open_checkpoints(
    url: str,
    *,
    replicate_to: str,
    replication: ReplicationPolicy | str = "all",
    durable_retention: RetentionPolicy | None = None,
    durable_options: Mapping[str, object] | None = None,
    create: bool = True,
    retention: RetentionPolicy | None = None,
    clock: Clock | None = None,
    background: bool = True,
    **options: object,
) -> TieredStore: ...


def open_checkpoints(
    url: str, *, replicate_to: str | None = None, **options: Any
) -> Store | TieredStore:
    """``ckptstore.open``: the store at ``url`` (``open_store``), or with ``replicate_to``
    a TieredStore saving to ``url`` and keeping copies in ``replicate_to`` (``open_tiered``)."""
    if replicate_to is not None:
        return open_tiered(url, replicate_to=replicate_to, **options)
    tiered_only = sorted(set(options) & _TIERED_OPTIONS)
    if tiered_only:
        raise InvalidOptionError(
            f"{url}: {', '.join(tiered_only)} need replicate_to=<durable store URL>"
        )
    return open_store(url, **options)


_TIERED_OPTIONS = frozenset({"replication", "durable_retention", "durable_options", "background"})


def open_tiered(
    url: str,
    *,
    replicate_to: str,
    replication: ReplicationPolicy | str = "all",
    durable_retention: RetentionPolicy | None = None,
    durable_options: Mapping[str, object] | None = None,
    create: bool = True,
    retention: RetentionPolicy | None = None,
    clock: Clock | None = None,
    background: bool = True,
    **options: object,
) -> TieredStore:
    """Open ``url`` as the fast tier and ``replicate_to`` as the durable one (see TieredStore).

    ``replication``: which checkpoints are copied (``"all"``, ``"newest"``, ``"every:N"``, or a
    ReplicationPolicy). ``retention`` is the fast tier's, ``durable_retention`` the durable
    tier's. ``options`` are the fast store's backend options, ``durable_options`` the durable
    store's. ``background=False`` runs no thread: replication happens in
    ``wait_replicated`` and ``close`` (for tests and tools).

    Raises InvalidOptionError for a durable URL that is the fast one or inside it (or the
    other way round) and for an unknown policy; ReplicationError (with the cause) when the
    durable store cannot be opened or read.
    """
    policy = replication_policy(replication)
    if durable_retention is not None and not isinstance(durable_retention, RetentionPolicy):
        raise InvalidOptionError(
            f"durable_retention must be a RetentionPolicy, got {durable_retention!r}"
        )
    durable_opts: dict[str, Any] = dict(durable_options or {})
    _check_apart(url, options, replicate_to, durable_opts)
    now = clock or time.time
    fast_opts: dict[str, Any] = dict(options)
    fast = open_store(url, create=create, retention=retention, clock=now, **fast_opts)
    try:
        replicator_fast = open_store(url, create=create, clock=now, **fast_opts)
        try:
            durable = open_store(replicate_to, create=create, clock=now, **durable_opts)
            writer = open_store(
                replicate_to, create=create, retention=durable_retention, clock=now, **durable_opts
            )
        except InvalidInputError:
            raise
        except CkptStoreError as exc:
            raise ReplicationError(
                f"replicate_to={replicate_to!r}: the durable store cannot be opened: {exc}"
            ) from exc
        replicator = Replicator(replicator_fast, writer, policy)
        try:
            replicator.refresh()  # reachable, and readable: said now, not in a thread later
        except InvalidInputError:
            raise
        except CkptStoreError as exc:
            raise ReplicationError(
                f"replicate_to={replicate_to!r}: the durable store cannot be read: {exc}"
            ) from exc
    except BaseException:
        fast.close()
        raise
    return TieredStore(fast, durable, replicator, background=background)


def _check_apart(
    url: str, options: Mapping[str, object], durable: str, durable_options: Mapping[str, object]
) -> None:
    """InvalidOptionError if the two stores are one location, or one lies inside the other."""
    a, b = _where(url, options), _where(durable, durable_options)
    if a[0] != b[0]:
        return
    if a[1] == b[1]:
        raise InvalidOptionError(
            f"replicate_to={durable!r} is the store being saved to ({url!r}): the durable "
            f"tier must be another location"
        )
    inner = a[1].startswith(b[1] + "/") or b[1].startswith(a[1] + "/")
    if inner:
        raise InvalidOptionError(
            f"replicate_to={durable!r} and {url!r}: one store lies inside the other; give the "
            f"tiers locations apart"
        )


def _where(url: str, options: Mapping[str, object]) -> tuple[tuple[str, str, str], str]:
    """A location's storage system (scheme family, host or bucket, endpoint) and path."""
    parsed = parse_url(url)
    scheme = parsed.scheme.split("+")[0] if "+versioned" in parsed.scheme else parsed.scheme
    endpoint = str(options.get("endpoint_url", parsed.query.get("endpoint_url", "")))
    path = parsed.path.rstrip("/") or "/"
    if scheme == "file":
        path = os.path.realpath(path)
    return (scheme, parsed.netloc, endpoint), path
