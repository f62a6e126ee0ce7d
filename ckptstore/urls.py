"""Store URLs: ``scheme://netloc/path?option=value``, parsed once into a StoreURL.

A bare path (``/scratch/run42``, ``./ckpts``) means ``file://`` with that path made absolute.
Query parameters are backend options, merged with (and overridden by) keyword arguments.
Credentials never belong in a URL: a password in the userinfo is refused here, and whatever
ckptstore says about a URL shows it through ``redact`` (``ckptstore.redaction``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from ckptstore.errors import InvalidOptionError, InvalidURLError
from ckptstore.redaction import has_password, redact

__all__ = [
    "StoreURL",
    "endpoint_option",
    "file_url",
    "option_bool",
    "option_int",
    "parse_url",
    "redact",
    "split_epoch",
    "split_incremental",
]

_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*$")


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL; ``query`` holds the URL's options as strings."""

    raw: str
    scheme: str
    netloc: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)

    @property
    def shown(self) -> str:
        """The URL as ckptstore prints it: secrets redacted."""
        return redact(self.raw)

    def reject_unknown(self, options: Mapping[str, object], *, allowed: Iterable[str]) -> None:
        """Raise InvalidOptionError for any option the backend does not know."""
        known = set(allowed)
        unknown = sorted(set(options) - known)
        if unknown:
            hint = f"; known options: {', '.join(sorted(known))}" if known else ""
            raise InvalidOptionError(
                f"{self.shown}: unknown option(s) {', '.join(unknown)} for {self.scheme}://{hint}"
            )


def parse_url(url: str) -> StoreURL:
    """Parse a store URL (or a bare file-system path); raise InvalidURLError if malformed."""
    if not isinstance(url, str) or not url:
        given = "an empty one" if url == "" else f"a {type(url).__name__}"  # never its value
        raise InvalidURLError(f"store URL must be a non-empty string, got {given}")
    if "://" not in url:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", url) and not os.path.exists(url):
            scheme = url.partition(":")[0]  # what follows the colon may be a secret
            raise InvalidURLError(f"{scheme}:... is not a URL (expected scheme://...) or a path")
        return StoreURL(raw=url, scheme="file", netloc="", path=os.path.abspath(url))
    shown = redact(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if not _SCHEME_RE.fullmatch(scheme):
        raise InvalidURLError(f"{shown!r}: invalid scheme {parts.scheme!r}")
    if has_password(url):
        raise InvalidURLError(
            f"{shown!r}: credentials (user:password@) do not belong in a URL, where they end "
            f"up in logs; pass them as options or through the storage's own credential chain"
        )
    if parts.fragment:
        raise InvalidURLError(f"{shown!r}: a store URL has no #fragment")
    try:
        query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False))
    except ValueError as exc:
        raise InvalidURLError(f"{shown!r}: bad query string") from exc
    return StoreURL(
        raw=url,
        scheme=scheme,
        netloc=parts.netloc,
        path=unquote(parts.path),
        query=query,
    )


_FILE_URL_QUOTED = {ord(ch): f"%{ord(ch):02X}" for ch in "%?#"} | {
    code: f"%{code:02X}" for code in (*range(0x20), 0x7F)
}


def file_url(path: str, scheme: str = "file") -> str:
    """The ``file://`` URL of an absolute ``path`` that ``parse_url`` reads back as ``path``.

    ``%``, ``?``, ``#`` and control characters are percent-encoded (a ``?`` would start the
    query, and a URL parser drops tabs and newlines); every other character is kept, so the
    URL reads like the path.
    """
    return f"{scheme}://{path.translate(_FILE_URL_QUOTED)}"


def endpoint_option(options: Mapping[str, object], name: str = "endpoint_url") -> str:
    """An endpoint URL option (empty if absent); InvalidOptionError if it carries a userinfo
    (``http://user:password@host``): credentials there would be logged with the endpoint."""
    value = options.get(name)
    if not value:
        return ""
    text = str(value)
    if "@" in text.partition("://")[2].partition("/")[0] or has_password(text):
        raise InvalidOptionError(
            f"{name} {redact(text)!r}: an endpoint takes no user:password@ part, where "
            f"credentials end up in logs; pass them as options or through the storage's own "
            f"credential chain"
        )
    return text


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


def split_incremental(url: StoreURL) -> tuple[StoreURL, bool | None]:
    """``url`` without its ``incremental`` option (the store's, not a backend's), and its
    value (None if not given)."""
    if "incremental" not in url.query:
        return url, None
    query = dict(url.query)
    incremental = option_bool(query, "incremental", False)
    del query["incremental"]
    return dataclasses.replace(url, query=query), incremental


def split_epoch(url: StoreURL) -> tuple[StoreURL, int | None]:
    """``url`` without its ``epoch`` option (the epoch a writer joins, docs/protocol.md §8.3:
    no backend's option), and that epoch (None if not given)."""
    if "epoch" not in url.query:
        return url, None
    query = dict(url.query)
    epoch = option_int(query, "epoch", 0)
    del query["epoch"]
    return dataclasses.replace(url, query=query), epoch
