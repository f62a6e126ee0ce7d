"""Store URLs: ``scheme://netloc/path?option=value``, parsed once into a StoreURL.

A bare path (``/scratch/run42``, ``./ckpts``) means ``file://`` with that path made absolute.
Query parameters are backend options, merged with (and overridden by) keyword arguments.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from ckptstore.errors import InvalidOptionError, InvalidURLError

__all__ = ["StoreURL", "option_bool", "option_int", "parse_url", "split_epoch"]

_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*$")


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL; ``query`` holds the URL's options as strings."""

    raw: str
    scheme: str
    netloc: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)

    def reject_unknown(self, options: Mapping[str, object], *, allowed: Iterable[str]) -> None:
        """Raise InvalidOptionError for any option the backend does not know."""
        known = set(allowed)
        unknown = sorted(set(options) - known)
        if unknown:
            hint = f"; known options: {', '.join(sorted(known))}" if known else ""
            raise InvalidOptionError(
                f"{self.raw}: unknown option(s) {', '.join(unknown)} for {self.scheme}://{hint}"
            )


def parse_url(url: str) -> StoreURL:
    """Parse a store URL (or a bare file-system path); raise InvalidURLError if malformed."""
    if not isinstance(url, str) or not url:
        raise InvalidURLError(f"store URL must be a non-empty string, got {url!r}")
    if "://" not in url:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", url) and not os.path.exists(url):
            raise InvalidURLError(f"{url!r} is not a URL (expected scheme://...) or a path")
        return StoreURL(raw=url, scheme="file", netloc="", path=os.path.abspath(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if not _SCHEME_RE.fullmatch(scheme):
        raise InvalidURLError(f"{url!r}: invalid scheme {parts.scheme!r}")
    if parts.fragment:
        raise InvalidURLError(f"{url!r}: a store URL has no #fragment")
    try:
        query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False))
    except ValueError as exc:
        raise InvalidURLError(f"{url!r}: bad query string: {exc}") from exc
    return StoreURL(
        raw=url,
        scheme=scheme,
        netloc=parts.netloc,
        path=unquote(parts.path),
        query=query,
    )


def option_int(options: Mapping[str, object], name: str, default: int, *, minimum: int = 0) -> int:
    """Read an integer option given as an int or a decimal string (URL query)."""
    value = options.get(name, default)
    if isinstance(value, bool):
        raise InvalidOptionError(f"option {name} must be an integer, got {value!r}")
    try:
        result = int(str(value))
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(f"option {name} must be an integer, got {value!r}") from exc
    if result < minimum:
        raise InvalidOptionError(f"option {name} must be >= {minimum}, got {result}")
    return result


def option_bool(options: Mapping[str, object], name: str, default: bool) -> bool:
    """Read a boolean option given as a bool or as 1/0, true/false, yes/no (URL query)."""
    value = options.get(name, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidOptionError(f"option {name} must be a boolean, got {value!r}")


def split_epoch(url: StoreURL) -> tuple[StoreURL, int | None]:
    """``url`` without its ``epoch`` option (the epoch a writer joins, docs/protocol.md §8.3:
    no backend's option), and that epoch (None if not given)."""
    if "epoch" not in url.query:
        return url, None
    query = dict(url.query)
    epoch = option_int(query, "epoch", 0)
    del query["epoch"]
    return dataclasses.replace(url, query=query), epoch
