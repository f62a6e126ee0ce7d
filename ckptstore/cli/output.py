"""What a command prints when it is done: a JSON document (``--json``) or a line of text."""

from __future__ import annotations

import json
from typing import Any, TextIO

__all__ = ["write_result"]


def write_result(out: TextIO, as_json: bool, document: Any, text: str) -> None:
    """Write ``document`` to ``out`` as JSON on one line if ``as_json``, else ``text``."""
    if as_json:
        json.dump(document, out)
        out.write("\n")
    else:
        out.write(text)
