"""The processes of a JAX job (``jax.distributed``) as a ``ckptstore.coordinated.Collective``.

Values travel as JSON through the key-value store of JAX's coordination service (the one
``jax.distributed.initialize`` starts, which Orbax uses too): no device collective, so a save
needs neither a compiled computation nor a CPU collectives backend. Each exchange has a key of
its own under the collective's namespace; a process that waits longer than ``timeout_s`` for
another (dead, or stuck) raises, and nothing is published.
"""

from __future__ import annotations

import json
from typing import Any

import jax

from ckptstore.coordinated import COORDINATOR
from ckptstore.errors import CkptStoreError

__all__ = ["JaxCollective", "coordination_client"]


def coordination_client() -> Any:
    """The client of JAX's coordination service, or CkptStoreError if there is none."""
    try:
        from jax._src.distributed import global_state
    except ImportError as exc:  # a JAX without the module (its layout is JAX's own)
        raise CkptStoreError(
            f"this JAX ({jax.__version__}) has no coordination service client that ckptstore "
            f"knows: multi-process saves need one"
        ) from exc
    client = getattr(global_state, "client", None)
    if client is None:
        raise CkptStoreError(
            "a multi-process JAX save needs jax.distributed.initialize() first (there are "
            f"{jax.process_count()} processes and no coordination service)"
        )
    return client


class JaxCollective:
    """Broadcast and gather of JSON values between the processes of a JAX job."""

    def __init__(self, namespace: str, *, timeout_s: float = 600.0) -> None:
        self.rank = jax.process_index()
        self.size = jax.process_count()
        self._client = coordination_client()
        self._namespace = namespace
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._calls = 0

    def _key(self, suffix: str) -> str:
        return f"{self._namespace}/{self._calls}/{suffix}"

    def _get(self, key: str) -> Any:
        try:
            text = self._client.blocking_key_value_get(key, self._timeout_ms)
        except Exception as exc:  # DEADLINE_EXCEEDED, or the service lost a process
            raise CkptStoreError(
                f"process {self.rank}: no answer for {key} within {self._timeout_ms / 1000:g} s "
                f"({type(exc).__name__}: {exc}): another process of the job died or is stuck"
            ) from exc
        return json.loads(text)

    def broadcast(self, value: Any) -> Any:
        self._calls += 1
        key = self._key("from-coordinator")
        if self.rank == COORDINATOR:
            self._client.key_value_set(key, json.dumps(value))
            return value
        return self._get(key)

    def gather(self, value: Any) -> list[Any] | None:
        self._calls += 1
        self._client.key_value_set(self._key(f"from-{self.rank}"), json.dumps(value))
        if self.rank != COORDINATOR:
            return None
        return [self._get(self._key(f"from-{rank}")) for rank in range(self.size)]
