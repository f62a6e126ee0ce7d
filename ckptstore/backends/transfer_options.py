"""The URL options every object-store backend takes about transfers, read once.

How large parts are and how many go at once, how often a call is tried, whether checksums are
sent, how long to wait to connect and for an answer: the same options, defaults and checks on
``s3://``, ``gs://`` and ``az://``. Also what opening any of them refuses (credentials in the
URL's query or its user@ part, where they would end up in logs) and the connection pool an HTTP
client gets.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ckptstore.commit.conditional_put import DEFAULT_PART_SIZE
from ckptstore.errors import InvalidOptionError, InvalidURLError
from ckptstore.urls import StoreURL, option_bool, option_int

__all__ = [
    "POOL_HEADROOM",
    "TRANSFER_OPTIONS",
    "TransferOptions",
    "pooled",
    "refuse_credentials_in_url",
]

TRANSFER_OPTIONS = (
    "endpoint_url",
    "concurrency",
    "part_size",
    "min_part_size",
    "max_attempts",
    "checksums",
    "connect_timeout",
    "read_timeout",
)
POOL_HEADROOM = 32
"""Connections beyond ``concurrency`` transfers: the threads that call a store (ranks in
threads, async saves, readers) and other stores opened with the same options, which share the
client. Unused slots cost nothing; a full pool discards connections with a warning."""


@dataclass(frozen=True)
class TransferOptions:
    """Parts, attempts, checksums and timeouts, as a URL's options set them."""

    concurrency: int
    min_part_size: int
    part_size: int
    max_attempts: int
    checksums: bool
    connect_timeout: int
    read_timeout: int

    @classmethod
    def read(cls, options: Mapping[str, object], *, min_part_size: int) -> TransferOptions:
        """The options' values (``min_part_size``: the storage's own minimum part size,
        the default; parts default to at least 8 MiB)."""
        least = option_int(options, "min_part_size", min_part_size, minimum=1)
        return cls(
            concurrency=option_int(options, "concurrency", 8, minimum=1),
            min_part_size=least,
            part_size=option_int(options, "part_size", max(DEFAULT_PART_SIZE, least), minimum=1),
            max_attempts=option_int(options, "max_attempts", 6, minimum=1),
            checksums=option_bool(options, "checksums", True),
            connect_timeout=option_int(options, "connect_timeout", 5, minimum=1),
            read_timeout=option_int(options, "read_timeout", 60, minimum=1),
        )

    @property
    def pool_size(self) -> int:
        """Connections an HTTP client keeps: a transfer's, and headroom."""
        return self.concurrency + POOL_HEADROOM


def refuse_credentials_in_url(url: StoreURL, credentials: Collection[str], where: str) -> None:
    """InvalidOptionError naming (never showing) any credential given in the URL's query."""
    leaked = sorted(set(url.query) & set(credentials))
    if leaked:
        raise InvalidOptionError(
            f"credentials ({', '.join(leaked)}) do not belong in a URL, where they end up in "
            f"logs; pass them as keyword arguments or through {where}"
        )


def bucket_of(url: StoreURL, named: str, credentials_from: str) -> str:
    """The bucket a URL names; InvalidURLError, never echoing it, for a ``user@`` part: what
    comes before the @ can only be a credential."""
    if "@" in url.netloc:
        raise InvalidURLError(
            f"{url.shown}: {named} names a bucket, with no user@ part; pass credentials as "
            f"options or through {credentials_from}"
        )
    return url.netloc


def pooled(session: Any, pool_size: int, **adapter: Any) -> Any:
    """``session`` (a requests session) keeping ``pool_size`` connections per host."""
    import requests.adapters

    mounted = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=pool_size, **adapter)
    session.mount("http://", mounted)
    session.mount("https://", mounted)
    return session
