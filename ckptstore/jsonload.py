"""The one JSON parser for everything ckptstore reads back from storage or a user's files.

Manifests, epoch records, state skeletons, DCP metadata and Lightning pointers are all parsed
here, with the same rules: the size is bounded before decoding, the nesting of arrays and
objects is measured without recursion *before* ``json.loads`` (whose parser recurses, and
raises ``RecursionError`` on a few kilobytes of ``[``: a damaged or planted document must be
an ordinary, named error, never a crash of every command), the constants ``NaN`` and
``Infinity`` (not JSON; ckptstore never writes them) are refused, and so is an object that
names a key twice (two parsers could disagree on which value counts, and a checksum computed
over one reading would not vouch for the other).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

__all__ = ["JSONDocumentError", "load_json", "nesting_exceeds"]


class JSONDocumentError(ValueError):
    """A document is not JSON within the bounds given. The message is a predicate ("is not
    valid JSON: ...", "nests arrays or objects deeper than 64 levels"): callers raise their own
    error from it (ManifestCorruptError, LineageCorruptError...), naming the document first."""


_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_LEVEL = {"[": 1, "{": 1, "]": -1, "}": -1}


def nesting_exceeds(text: str, limit: int) -> bool:
    """Tell whether JSON ``text`` nests arrays and objects deeper than ``limit`` (iterative,
    and linear: escaped backslashes and quotes are dropped, the text is split at the quotes
    that remain, and only the brackets outside strings are walked)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    # Outside a string a backslash is not JSON: whatever it does there, the parse fails later.
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2])
    brackets = _NOT_BRACKETS.sub("", outside)
    return max(itertools.accumulate(_LEVEL[b] for b in brackets), default=0) > limit


def _refuse_constant(name: str) -> Any:
    raise JSONDocumentError(f"holds {name}, which is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONDocumentError(f"names the key {key!r} twice in one object")
            seen.add(key)
    return document


def load_json(data: bytes | bytearray | memoryview | str, *, max_bytes: int, max_depth: int) -> Any:
    """Parse one JSON document, or raise JSONDocumentError saying what is wrong with it.

    ``max_bytes``: the longest document accepted (checked before anything is decoded);
    ``max_depth``: the deepest nesting of arrays and objects (``[]`` is depth 1).
    """
    if len(data) > max_bytes:
        raise JSONDocumentError(f"is larger than {max_bytes} bytes")
    if isinstance(data, str):
        text = data
    else:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONDocumentError(f"is not UTF-8: {exc}") from exc
    if nesting_exceeds(text, max_depth):
        raise JSONDocumentError(f"nests arrays or objects deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except JSONDocumentError:
        raise
    except RecursionError as exc:  # a caller already deep in its stack: still no crash
        raise JSONDocumentError("nests arrays or objects too deeply to parse here") from exc
    except ValueError as exc:  # json.JSONDecodeError
        raise JSONDocumentError(f"is not valid JSON (truncated or overwritten?): {exc}") from exc
