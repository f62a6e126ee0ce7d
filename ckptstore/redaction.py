"""The one redaction of secrets in URLs: every URL ckptstore prints, logs or stores goes through
``redact`` (errors, warnings, ``ls`` and reports, a replica's ``source``, progress lines).

A URL can carry credentials where a user pasted them: a password in the userinfo
(``s3://KEY:SECRET@bucket``), a token as the user name (``https://TOKEN@host``), a signed or
token query (an Azure SAS ``sig=``, an S3 presigned ``X-Amz-Signature=``, a GCS ``token=``), or
a URL-valued option that carries one (``endpoint_url=http://user:SECRET@host``). ckptstore
refuses such credentials where it reads them, and whatever it says about such a URL shows
``***`` in their place. This module imports nothing of ckptstore: ``ckptstore.errors`` applies
it to every error message.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote_plus

__all__ = ["REDACTED", "has_password", "is_secret_option", "redact"]

REDACTED = "***"
"""What a secret is replaced with."""

_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`\\]*")
"""A URL inside text: a scheme, ``://``, and everything up to a space, a quote or a bracket."""

_SECRET_WORD_RE = re.compile(
    r"sig|signature|secret|(\w*)(token|key|secret|password)|passw(or)?d|pwd|credentials?|auth"
    r"|authorization|sas|session|cookie|private|connection"
)
"""A word of a query option's name (split at ``-``, ``_`` and ``.``) that makes its value a
(possible) secret: ``sig`` (Azure SAS), ``X-Amz-Signature``, ``X-Amz-Credential`` and
``X-Amz-Security-Token`` (S3 presigned), ``X-Goog-Signature``, ``token``, ``access_token``,
``password``, ``account_key``, ``AccountKey``, ``connection_string``..."""

_NAMED_BY_USER = frozenset({"az", "abfs", "abfss", "wasb", "wasbs"})
"""Schemes whose user name is not a credential: ``az://container@account``."""


def is_secret_option(name: str) -> bool:
    """Whether a URL option named ``name`` may hold a secret (its value is never shown)."""
    words = re.split(r"[-_.\s]+", unquote_plus(name).lower())
    return any(_SECRET_WORD_RE.fullmatch(word) for word in words)


def redact(text: str) -> str:
    """``text`` with the secrets of every URL in it replaced by ``***``.

    The password of a userinfo (``user:***@host``), a user name alone (``***@host``: a token,
    except where it names an Azure container), the value of every query option named like a
    secret (``sig=***``, ``X-Amz-Signature=***``, ``token=***``), the secrets of a URL given as
    an option's value (``endpoint_url=http://user:***@host``), and a fragment. Text without
    ``://`` (a bare path, a message naming none) is returned as it is.
    """
    if "://" not in text:
        return text
    return _URL_RE.sub(_redact_match, text)


def _redact_match(match: re.Match[str]) -> str:
    url = match.group(0)
    kept = url.rstrip(":,.;)]}")  # the punctuation of the sentence a URL ends
    return _redact_url(kept) + url[len(kept) :]


def has_password(url: str) -> bool:
    """Whether ``url`` carries a password in its userinfo (``scheme://user:password@host``)."""
    if "://" not in url:
        return False
    rest = url.partition("://")[2].partition("#")[0].partition("?")[0]
    userinfo = _split_authority(rest)[0]
    return userinfo is not None and ":" in userinfo


def _split_authority(rest: str) -> tuple[str | None, str, str]:
    """``rest`` (a URL after ``://``, before ``?`` and ``#``) as userinfo (None: none), host
    and path. A password may hold a ``/`` (AWS secret keys do), which ends the authority for
    a URL parser: a ``user:pass/word@host`` is taken as a userinfo too, unless what follows
    the colon is a port."""
    slash = rest.find("/")
    head = rest if slash < 0 else rest[:slash]
    at = head.rfind("@")
    if at >= 0:
        return head[:at], head[at + 1 :], rest[len(head) :]
    colon = head.find(":")
    after = head[colon + 1 :]
    if colon >= 0 and slash >= 0 and after and not after.isdigit():
        at = rest.find("@", slash)
        if at >= 0:
            host, sep, path = rest[at + 1 :].partition("/")
            return rest[:at], host, sep + path
    return None, head, rest[len(head) :]


def _redact_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    rest, hash_sign, fragment = rest.partition("#")
    rest, question, query = rest.partition("?")
    userinfo, host, path = _split_authority(rest)
    authority = host
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        family = scheme.lower().removeprefix("fsspec+")
        if colon:
            userinfo = f"{user}:{REDACTED}"
        elif family not in _NAMED_BY_USER:
            userinfo = REDACTED
        authority = f"{userinfo}@{host}"
    if query:
        query = "&".join(_redact_option(part) for part in query.split("&"))
    if fragment:
        fragment = REDACTED
    return f"{scheme}://{authority}{path}{question}{query}{hash_sign}{fragment}"


def _redact_option(part: str) -> str:
    name, equals, value = part.partition("=")
    if not equals or not value:
        return part
    if is_secret_option(name):
        return f"{name}={REDACTED}"
    decoded = unquote_plus(value)
    if "://" in decoded:  # a URL as an option's value: endpoint_url=...
        shown = redact(decoded)
        if shown != decoded:
            return f"{name}={shown if decoded == value else quote(shown, safe=':/@*')}"
    return part
