"""A derandomized run of the state machine draws the same examples whatever else is imported.

Hypothesis (6.131 and later) sometimes draws a constant found in the source of the "local"
modules (those outside site-packages and the standard library) that are imported when it
draws: ckptstore itself when run from a checkout, the tests, their conftest. Which modules
those are depends on what ran before in the same interpreter (under pytest-xdist, on which
tests the scheduler happened to hand that worker first), on lazy imports, and on every edit
anywhere in those modules; so the same derandomized settings explored different examples from
run to run, and a bug one run found another missed. ``same_examples`` draws from hypothesis's
own constants only, for as long as it is entered: the examples then depend on the seed and on
what the machine under test does, nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["same_examples"]


@contextlib.contextmanager
def same_examples() -> Iterator[None]:
    """While entered, hypothesis draws no constant taken from imported modules' source (a
    no-op on a hypothesis that draws none)."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - hypothesis reorganised: nothing to freeze
        yield
        return
    local: Any = getattr(providers, "_get_local_constants", None)
    empty: Any = getattr(providers, "_local_constants", None)
    cache: Any = getattr(providers, "CONSTANTS_CACHE", None)
    if local is None or empty is None or cache is None:
        yield
        return
    none = type(empty)()  # no constants of any type
    cache.cache.clear()  # pools computed with the modules' constants
    providers._get_local_constants = lambda: none  # noqa: SLF001  no public switch
    try:
        yield
    finally:
        providers._get_local_constants = local  # noqa: SLF001
        cache.cache.clear()
