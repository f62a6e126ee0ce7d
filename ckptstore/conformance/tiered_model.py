"""What a replicator copies, told to the model of its durable store: a copy is a save there.

Shared by the tiered layer (``layers/tiers.py``) and the state machine's tiered rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptstore.conformance.model import Model, Saved
from ckptstore.errors import CkptStoreError
from ckptstore.manifest import TIER_KEY, Manifest
from ckptstore.tiers.replication import Replicator

__all__ = ["tell_model"]


def tell_model(replicator: Replicator, model: Model, epoch: int = 0) -> None:
    """Tell ``model`` of each copy ``replicator`` makes: in doubt from its start, committed
    once the durable publish returned (before the hint and retention), as ``workload.save``
    does for saves. A copy is a save of the durable epoch its source was written in (the
    fast tier's record says which; ``epoch`` where it says none): one outside the history
    is superseded at once, never to be visible (I9), whichever epoch copies it."""
    replicate = replicator.replicate
    strategy = replicator.durable.strategy
    publish = strategy.publish
    copying: dict[int, Saved] = {}

    def replicate_and_tell(step: int) -> bool:
        try:
            source = replicator.fast.get(step)
        except CkptStoreError:
            return replicate(step)  # gone (or unreadable): the replicator decides
        shards = {name: source.read(name) for name in source.names}
        # The copy's metadata is the trainer's: the fast tier's record stays in its source.
        metadata = {k: v for k, v in source.metadata.items() if k != TIER_KEY}
        saved = Saved(step, shards, metadata, _written_in(source.metadata, epoch))
        model.save_started(saved)
        copying[step] = saved
        try:
            return replicate(step)
        finally:
            copying.pop(step, None)

    def publish_and_tell(manifest: Manifest) -> None:
        publish(manifest)
        saved = copying.get(manifest.step)
        if saved is not None:
            model.save_committed(saved)

    replicator.replicate = replicate_and_tell  # type: ignore[method-assign]
    strategy.publish = publish_and_tell  # type: ignore[method-assign]


def _written_in(metadata: Mapping[str, Any], default: int) -> int:
    """The durable epoch a fast-tier checkpoint was written in, by its tier record."""
    record = metadata.get(TIER_KEY)
    epoch = record.get("durable_epoch") if isinstance(record, Mapping) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else default
