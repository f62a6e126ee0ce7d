"""A fast store for saving and a durable one for keeping, as one store a trainer uses.

``ckptstore.open(url, replicate_to=durable_url)`` returns a ``TieredStore``: every save is
published in the fast store (node-local NVMe, tmpfs) with that store's protocol, so the trainer
waits only for it; a ``Replicator`` thread copies published checkpoints to the durable store
(S3, GCS, a parallel file system) as its policy says, and publishes each there with the
durable store's protocol. Readers answer across both: ``latest()`` is the newest checkpoint
published and complete in either, read from the fast copy where both hold it, so a job
restarted on a new node (an empty fast store) resumes from the durable one. The pair has one
history, the durable store's lineage: each fast checkpoint records the durable epoch its
writer was in, and one the durable lineage does not hold (a node cut off from the durable
store while another took over; a rollback of the pair) is never returned, copied or counted,
and is reported. A takeover and a rollback are the pair's: the durable tier decides, the
fast one follows. Each tier has its own retention; the fast tier's never removes a checkpoint
still owed to the durable tier.
The protocol and its guarantees: docs/protocol.md, "Tiers"; the user's page: docs/tiers.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, overload
from urllib.parse import quote, unquote

from ckptstore.checkpoint import Checkpoint
from ckptstore.commit.base import GcItem, GcReport
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    IntegrityError,
    InvalidInputError,
    InvalidMetadataError,
    InvalidOptionError,
    InvalidURLError,
    ReplicationError,
)
from ckptstore.interface import CheckpointStore
from ckptstore.lineage import Epoch, Lineage
from ckptstore.names import check_step
from ckptstore.pending import PendingCheckpoint
from ckptstore.redaction import redact
from ckptstore.retention import RetentionPolicy
from ckptstore.signing import Trust, signing_key_from, trust_from
from ckptstore.store import DEFAULT_GRACE, Clock, Store, newest_refused, open_store
from ckptstore.tiers.replication import (
    TIER_KEY,
    KeepOwed,
    OutsideCheckpoint,
    ReplicationPolicy,
    Replicator,
    outside_history,
    replication_policy,
    shown_url,
)
from ckptstore.urls import parse_url, split_incremental

__all__ = [
    "TIERED_URL_OPTIONS",
    "TieredGcReport",
    "TieredStore",
    "open_checkpoints",
    "open_tiered",
    "split_tiered_url",
    "tiered_url",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TieredGcReport:
    """What GC removed in each tier."""

    fast: GcReport
    durable: GcReport


class TieredStore(CheckpointStore):
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
            fast.retention = KeepOwed(fast.retention, replicator, self._not_counted)
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
        self, step: int, metadata: Mapping[str, object] | None = None, **options: Any
    ) -> PendingCheckpoint:
        """Start saving ``step`` in the fast store (``Store.begin``, whose keyword options it
        takes: ``expected_shards``, ``world_size``, ``attempt``); once it publishes there, the
        replicator is told. The manifest's metadata records the durable store and the durable
        epoch this writer is in (``TIER_KEY``, docs/protocol.md §9.3, T5)."""
        return self.fast.begin(step, self._recorded(metadata), **options)

    def _recorded(self, metadata: Mapping[str, object] | None) -> Mapping[str, object] | None:
        if metadata is not None and not isinstance(metadata, Mapping):
            return metadata  # Store.begin says what is wrong with it
        if metadata is not None and TIER_KEY in metadata:
            raise InvalidMetadataError(
                f"metadata key {TIER_KEY!r} is reserved: a tiered store records the durable "
                f"epoch there"
            )
        record = {"durable": shown_url(self.durable_url), "durable_epoch": self.durable_epoch}
        return {**(metadata or {}), TIER_KEY: record}

    @property
    def durable_epoch(self) -> int:
        """The durable epoch this pair's writer is in (the replicator writes its copies in
        it): the one its takeover took, else the newest when the pair was opened or first
        saved to."""
        writer = self.replicator.durable
        if writer.epoch is None:
            writer.join_epoch(self.durable.lineage().newest)
        assert writer.epoch is not None
        return writer.epoch

    def join(self, step: int, attempt: str) -> PendingCheckpoint:
        """Write shards into a coordinator's attempt in the fast store (``Store.join``)."""
        return self.fast.join(step, attempt)

    # -- reading: either tier ------------------------------------------------------------

    def latest(self, *, verified: bool = False) -> Checkpoint | None:
        """The newest checkpoint of the pair's history published and complete in either
        tier, or None.

        Where both hold it, the fast copy is returned. A fast checkpoint outside the durable
        history (T5) is passed over, and reported once. A damaged newest checkpoint in the
        fast tier (an IntegrityError without ``verified``) is answered by the durable copy of
        that step or a newer one; without one, the error is raised, as ``Store.latest`` does.
        """
        damaged: IntegrityError | None = None
        try:
            fast = self.fast.latest(verified=verified)
        except IntegrityError as exc:
            fast, damaged = None, exc
        durable = self.durable.latest(verified=verified)
        lineage = self.durable.lineage()  # after what it judges (docs/protocol.md §8.2)
        if damaged is not None:
            listed = self.fast.named_steps()  # the damaged one among them
            if durable is None or (listed and durable.step < listed[-1]):
                raise damaged
            return durable
        if fast is not None and not self._holds(fast, lineage):
            floor = -1 if durable is None else durable.step
            fast = self._newest_held(fast.step, floor, lineage, verified=verified)
        if fast is None or (durable is not None and durable.step > fast.step):
            return durable
        return fast

    def _newest_held(
        self, below: int, floor: int, lineage: Lineage, *, verified: bool
    ) -> Checkpoint | None:
        """The newest fast checkpoint below ``below`` and at or above ``floor`` in the durable
        history, or None."""
        for step in reversed(self.fast.steps()):
            if step >= below:
                continue
            if step < floor:
                return None
            try:
                checkpoint = self.fast.get(step)
            except CheckpointNotFoundError:
                continue
            except IntegrityError:
                if verified:
                    continue
                raise
            if not self._holds(checkpoint, lineage):
                continue
            if verified and not checkpoint.verify().ok:
                continue
            return checkpoint
        return None

    def _holds(self, checkpoint: Checkpoint, lineage: Lineage) -> bool:
        """Whether a fast checkpoint is in the durable history; if not, say so once."""
        outside = outside_history(checkpoint.manifest, lineage)
        if outside is None:
            return True
        self.replicator.report(outside)
        return False

    def outside_history(self) -> list[OutsideCheckpoint]:
        """The fast tier's checkpoints that the durable lineage does not hold, ascending: a
        partitioned node's branch, or what a rollback of the pair left in the fast tier.
        ``ckptstore ls FAST --replicate-to DURABLE`` lists them."""
        found = []
        steps = self.fast.steps()
        lineage = self.durable.lineage()
        for step in steps:
            try:
                manifest = self.fast.manifest(step)
            except (CheckpointNotFoundError, IntegrityError):
                continue
            outside = outside_history(manifest, lineage)
            if outside is not None:
                found.append(outside)
        return found

    def _not_counted(self, steps: Sequence[int]) -> set[int]:
        """For the fast tier's retention: which of ``steps`` are outside the durable history
        as the replicator last read its epochs (a node cut off from the durable store goes by
        what it knew; nothing is removed on the strength of it)."""
        lineage = self.replicator.lineage
        if lineage is None:
            return set()
        found = set()
        for step in steps:
            try:
                manifest = self.fast.manifest(step)
            except (CheckpointNotFoundError, IntegrityError):
                continue
            if outside_history(manifest, lineage) is not None:
                found.add(step)
        return found

    def take_over(
        self, resumed_from: int | None, *, note: str = "", **options: Any
    ) -> tuple[Epoch, Epoch]:
        """Take both tiers over for this run (``Store.take_over``), resumed from the same
        step: the durable tier first (it decides the pair's history), then the fast one. A
        zombie of an earlier run can then no longer publish into either history, nor its
        replicator into the durable one, and the fast tier's checkpoints above the step leave
        the pair's history. Returns the fast and the durable epoch. ``from_epoch`` names the
        durable epoch of ``resumed_from`` (an undo, ``Store.take_over``); ``discard_history``
        is the word a fresh start over a history needs, on both tiers (``options``: those two,
        the durable tier's)."""
        with self.replicator.paused():
            durable = self.replicator.durable.take_over(resumed_from, note=note, **options)
            fast = self.fast.take_over(resumed_from, note=note, discard_history=True)
        return fast, durable

    def join_epochs(self, fast: int, durable: int) -> None:
        """Write in the epochs a takeover of the pair took (``take_over``'s, in another
        process of this run: a multi-rank job's coordinator): ``fast`` in the fast tier, and
        the replicator's copies in ``durable`` (``Store.join_epoch`` of each)."""
        self.fast.join_epoch(fast)
        self.replicator.durable.join_epoch(durable)

    def rollback(self, step: int) -> list[int]:
        """Roll the pair back to ``step``: a takeover of both tiers from it (durable first),
        so that every checkpoint newer than ``step`` leaves the history of both at once, is
        never returned, copied back or counted again, and is collected by each tier's GC.
        Returns the steps that left the pair's history.

        ``step`` must be durable (CheckpointNotFoundError otherwise: wait for its copy, or
        roll back to a durable step). A rollback of one tier alone is not the pair's: the
        durable tier's alone is obeyed by the fast one (its newer checkpoints fall outside the
        durable history); ``ckptstore rollback`` refuses the fast tier's alone.
        """
        check_step(step)
        try:
            self.durable.get(step)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self.durable_url}: cannot roll the pair back to step {step}: the durable "
                f"tier does not hold it ({exc}); wait for its copy (wait_replicated) or roll "
                f"back to a durable step: {self.durable.steps()[-5:]}",
                url=self.durable_url,
                step=step,
            ) from exc
        newer = [s for s in self.steps() if s > step]
        with self.replicator.paused():
            # The durable tier's rollback holds ``step`` against its deleters (docs/protocol.md
            # §8.5); the fast tier follows the durable history whatever it holds.
            self.replicator.durable.rollback(step)
            self.fast.take_over(step, note=f"rollback to step {step}", discard_history=True)
        return newer

    def get(self, step: int) -> Checkpoint:
        """The checkpoint of the pair's history at ``step``: the fast copy, else the durable
        one (``Store.get``). A fast checkpoint outside the durable history is not returned."""
        try:
            checkpoint = self.fast.get(step)
        except (CheckpointNotFoundError, IntegrityError) as fast_error:
            try:
                return self.durable.get(step)
            except CheckpointNotFoundError:
                raise fast_error from None
        if self._holds(checkpoint, self.durable.lineage()):
            return checkpoint
        try:
            return self.durable.get(step)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"{self.url}: step {step} of the fast tier is not in the pair's history (the "
                f"durable lineage of {self.durable_url} does not hold it), and the durable "
                f"tier has no checkpoint at step {step}",
                url=self.url,
                step=step,
            ) from None

    def steps(self) -> list[int]:
        """Every step of the pair's history published in either tier, ascending."""
        return sorted({c.step for c in self._fast_held()} | set(self.durable.steps()))

    def checkpoints(self) -> list[Checkpoint]:
        """Every complete checkpoint of the pair's history in either tier, ascending, the
        fast copy where both hold one."""
        found = {checkpoint.step: checkpoint for checkpoint in self.durable.checkpoints()}
        found.update((checkpoint.step, checkpoint) for checkpoint in self._fast_held())
        return [found[step] for step in sorted(found)]

    def _fast_held(self) -> list[Checkpoint]:
        checkpoints = self.fast.checkpoints()
        lineage = self.durable.lineage()
        return [checkpoint for checkpoint in checkpoints if self._holds(checkpoint, lineage)]

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
        from either, ascending. In the fast tier, what the durable tier is still owed is kept,
        and checkpoints outside the durable history are neither counted nor removed."""
        fast_policy = (
            None if policy is None else KeepOwed(policy, self.replicator, self._not_counted)
        )
        removed = set(self.fast.apply_retention(fast_policy))
        durable_policy = policy or self.replicator.durable.retention
        if durable_policy is not None:
            # No copy runs meanwhile: a copy's publish runs the durable store's own retention
            # through the same Store, and two deleters of one step would share its intent.
            with self.replicator.paused():
                removed |= set(self.replicator.durable.apply_retention(durable_policy))
        return sorted(removed)

    def delete(self, step: int, *, force: bool = False) -> None:
        """Unpublish ``step`` from the pair's history: from each tier that holds it (the fast
        one first), then delete its data (``Store.delete``). No copy runs meanwhile, and a step
        deleted before its copy is no longer owed: it is never copied afterwards.

        Refuses (RefusedError) to delete the pair's newest checkpoint unless ``force``;
        CheckpointNotFoundError if the pair's history has no checkpoint at ``step`` (a fast
        checkpoint outside it is not the pair's: the fast tier's GC collects it).
        """
        check_step(step)
        with self.replicator.paused():
            steps = self.steps()
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"{self.url}: the pair (durable: {self.durable_url}) has no published "
                    f"checkpoint at step {step}",
                    url=self.url,
                    step=step,
                )
            if step == steps[-1] and not force:
                raise newest_refused(self.url, step, "the pair's newest", "a rollback of the pair")
            for store in (self.fast, self.replicator.durable):
                try:
                    store.delete(step, force=True)
                except CheckpointNotFoundError:
                    continue  # this tier does not hold it (not yet copied, or removed)

    def gc(
        self, *, grace: timedelta | float = DEFAULT_GRACE, dry_run: bool = False
    ) -> TieredGcReport:
        """Collect dead attempts' leftovers in both tiers (``Store.gc``), copies the
        replicator abandoned included, and the fast checkpoints outside the durable history
        for good (T5: their durable epoch is known and owns not their step, so they never
        return to it) once the epoch that put them out is older than ``grace``."""
        fast = self.fast.gc(grace=grace, dry_run=dry_run)
        durable = self.durable.gc(grace=grace, dry_run=dry_run)
        self._collect_outside(
            fast, grace.total_seconds() if isinstance(grace, timedelta) else grace
        )
        return TieredGcReport(fast=fast, durable=durable)

    def _collect_outside(self, report: GcReport, grace_s: float) -> None:
        lineage = self.durable.lineage()
        now = self.fast.clock()
        for entry in self.outside_history():
            if entry.durable_epoch is None or not lineage.knows(entry.durable_epoch):
                continue  # not judged for good: an unreadable record, an epoch not read
            since = lineage.epoch(max(entry.owner, entry.durable_epoch))
            age = now - since.started_at.timestamp() if since is not None else 0.0
            name = (
                f"step {entry.step} of the fast tier (durable epoch {entry.durable_epoch}; the "
                f"durable history gives the step to epoch {entry.owner})"
            )
            if since is None or age < grace_s:
                report.kept_young.append(GcItem("outside the durable history", name, age))
                continue
            try:
                manifest = self.fast.manifest(entry.step)
            except (CheckpointNotFoundError, IntegrityError):
                continue
            if manifest.attempt != entry.attempt:
                continue  # published again since it was judged
            report.removed.append(
                GcItem("outside the durable history", name, age, manifest.total_size)
            )
            if not report.dry_run:
                try:
                    self.fast.delete(entry.step, force=True)
                except CheckpointNotFoundError:
                    continue

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

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
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
    a TieredStore saving to ``url`` and keeping copies in ``replicate_to`` (``open_tiered``).

    ``replicate_to`` and ``replication`` may also be given in the URL's query, the durable
    URL percent-encoded (``tiered_url`` builds such a URL): so everything that takes a URL
    (the adapters, the CLI) opens a tiered store. Keyword options override the URL's.
    """
    url, from_url = split_tiered_url(url)
    if "replicate_to" in from_url:
        if replicate_to is not None and replicate_to != from_url["replicate_to"]:
            raise InvalidOptionError(
                f"{redact(url)}: the URL says replicate_to={redact(from_url['replicate_to'])!r}, "
                f"the replicate_to option {redact(replicate_to)!r}: give one"
            )
        replicate_to = from_url["replicate_to"]
    if "replication" in from_url:
        options.setdefault("replication", from_url["replication"])
    if replicate_to is not None:
        return open_tiered(url, replicate_to=replicate_to, **options)
    tiered_only = sorted(set(options) & _TIERED_OPTIONS)
    if tiered_only:
        raise InvalidOptionError(
            f"{url}: {', '.join(tiered_only)} need replicate_to=<durable store URL>", url=url
        )
    return open_store(url, **options)


_TIERED_OPTIONS = frozenset({"replication", "durable_retention", "durable_options", "background"})

TIERED_URL_OPTIONS = ("replicate_to", "replication")
"""The options a store URL's query may carry to make it a tiered store's (``tiered_url``)."""


def tiered_url(url: str, replicate_to: str, *, replication: str | None = None) -> str:
    """The one URL of the tiered store saving to ``url`` and copying to ``replicate_to``:
    ``url`` with ``replicate_to=<the durable URL, percent-encoded>`` (and ``replication=``)
    added to its query. ``ckptstore.open`` of it is ``ckptstore.open(url,
    replicate_to=replicate_to, replication=replication)``; printed, it is redacted as any
    URL is (the durable URL's secrets included)."""
    if "://" not in url:
        raise InvalidURLError(
            f"{url!r}: a tiered store's URL needs a scheme (file:///path)", url=url
        )
    _, from_url = split_tiered_url(url)
    if from_url:
        raise InvalidOptionError(f"{redact(url)}: already names {', '.join(sorted(from_url))}")
    added = [f"replicate_to={quote(replicate_to, safe='')}"]
    if replication is not None:
        added.append(f"replication={quote(replication, safe='')}")
    head, hash_sign, fragment = url.partition("#")
    separator = "&" if "?" in head else "?"
    return f"{head}{separator}{'&'.join(added)}{hash_sign}{fragment}"


def split_tiered_url(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without the tier options of its query (``TIERED_URL_OPTIONS``), and those
    options decoded. A durable URL may be given percent-encoded (``tiered_url``) or as it is
    when it has no ``&`` of its own (``?replicate_to=s3+versioned://bucket/run``: its ``+``
    is kept, not read as a space). A bare path has no query: it is returned as it is."""
    if "://" not in url:
        return url, {}
    head, hash_sign, fragment = url.partition("#")
    base, question, query = head.partition("?")
    if not question:
        return url, {}
    kept: list[str] = []
    found: dict[str, str] = {}
    for part in query.split("&"):
        name, _, value = part.partition("=")
        name = unquote(name)
        if name not in TIERED_URL_OPTIONS:
            kept.append(part)
            continue
        if name in found:
            raise InvalidURLError(f"{redact(url)}: {name} is given twice")
        if not value:
            raise InvalidURLError(f"{redact(url)}: {name} is empty")
        found[name] = unquote(value)
    if not found:
        return url, {}
    rest = f"?{'&'.join(kept)}" if kept else ""
    return f"{base}{rest}{hash_sign}{fragment}", found


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
    if split_tiered_url(replicate_to)[1]:
        raise InvalidOptionError(
            f"replicate_to={redact(replicate_to)!r}: a durable store is one store, not a tiered "
            f"pair: give its URL without replicate_to or replication"
        )
    if durable_retention is not None and not isinstance(durable_retention, RetentionPolicy):
        raise InvalidOptionError(
            f"durable_retention must be a RetentionPolicy, got {durable_retention!r}"
        )
    durable_opts: dict[str, Any] = dict(durable_options or {})
    _check_apart(url, options, replicate_to, durable_opts)
    now = clock or time.time
    fast_opts: dict[str, Any] = dict(options)
    # One key and one trust for the pair (read once, from the options or the environment):
    # the trainer's store and the durable store sign (a takeover of the pair signs its epoch
    # records in both); the replicator's stores never sign: a copy keeps the first signature.
    key = signing_key_from(fast_opts.pop("signing_key", None))
    given_trust = fast_opts.pop("trust", None)
    trust = trust_from(given_trust)
    if trust is None and key is not None and given_trust is not False:
        trust = Trust([key.public_key()])  # as open_store: a signer reads what it signed
    keys: dict[str, Any] = {"signing_key": key or False, "trust": trust or False}
    no_key: dict[str, Any] = {"signing_key": False, "trust": trust or False}
    fast = open_store(url, create=create, retention=retention, clock=now, **keys, **fast_opts)
    try:
        replicator_fast = open_store(url, create=create, clock=now, **no_key, **fast_opts)
        try:
            durable_opts.pop("signing_key", None)
            durable_opts.pop("trust", None)
            durable = open_store(replicate_to, create=create, clock=now, **keys, **durable_opts)
            writer = open_store(
                replicate_to,
                create=create,
                retention=durable_retention,
                clock=now,
                **no_key,
                **_sharing_copies(fast, durable, replicate_to, durable_opts),
            )
        except InvalidInputError:
            raise
        except CkptStoreError as exc:
            raise ReplicationError(
                f"replicate_to={replicate_to!r}: the durable store cannot be opened: {exc}"
            ) from exc
        writer.sign_epochs_with(key)  # the pair's durable takeovers are signed; copies never
        replicator = Replicator(replicator_fast, writer, policy)
        try:
            replicator.refresh()  # reachable, and readable: said now, not in a thread later
            if writer.epoch is None:  # the pair's writer is in the durable epoch of now
                writer.join_epoch(writer.lineage().newest)
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


def _sharing_copies(
    fast: Store, durable: Store, durable_url: str, durable_options: Mapping[str, object]
) -> dict[str, Any]:
    """The replicator's durable options: incremental where the fast tier saves incrementally
    and the durable store can share (what the durable tier holds is not copied again, §12.4),
    unless the durable options or URL say otherwise."""
    options = dict(durable_options)
    said = "incremental" in options or split_incremental(parse_url(durable_url))[1] is not None
    if fast.incremental and not said and durable.strategy.shares_shards:
        options["incremental"] = True
    return options


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
            f"tier must be another location",
            url=url,
        )
    inner = a[1].startswith(b[1] + "/") or b[1].startswith(a[1] + "/")
    if inner:
        raise InvalidOptionError(
            f"replicate_to={durable!r} and {url!r}: one store lies inside the other; give the "
            f"tiers locations apart",
            url=url,
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
