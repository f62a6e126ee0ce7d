"""pytest plugin of the suite: ``pytest --pyargs ckptstore.conformance --ckpt-url URL``.

Registered through the ``pytest11`` entry point, so its options exist in every pytest run
where ckptstore is installed; it imports nothing heavy until a conformance test asks for it.
Without ``--ckpt-url`` the suite runs on every built-in backend on embedded defaults.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckptstore", "ckptstore conformance suite")
    group.addoption(
        "--ckpt-url",
        action="append",
        default=[],
        metavar="URL",
        help="store URL to run the conformance suite on (repeatable; default: built-ins)",
    )
    group.addoption(
        "--ckpt-profile", choices=("ci", "thorough"), default="ci", help="how hard to try"
    )
    group.addoption("--ckpt-yes", action="store_true", help="run even where a URL is not empty")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "ckpt_target" in metafunc.fixturenames:
        from ckptstore.conformance.defaults import EMBEDDED_SCHEMES

        urls = metafunc.config.getoption("ckpt_url") or [
            f"<embedded {scheme}>" for scheme in EMBEDDED_SCHEMES
        ]
        metafunc.parametrize("ckpt_target", urls, scope="session")


@pytest.fixture(scope="session")
def ckpt_embedded() -> Iterator[dict[str, Any]]:
    """The built-in backends on embedded defaults, by placeholder name."""
    from ckptstore.conformance.defaults import embedded_targets

    with embedded_targets() as targets:
        yield {f"<embedded {t.url.split(':', 1)[0]}>": t for t in targets}


@pytest.fixture(scope="session")
def ckpt_checked_target(ckpt_target: str, ckpt_embedded: dict[str, Any], request: Any) -> Any:
    """The target under test, refused if it holds data and --ckpt-yes was not given."""
    from ckptstore.conformance.runner import Target
    from ckptstore.errors import RefusedError
    from ckptstore.store import open_store

    if ckpt_target.startswith("<embedded"):
        if ckpt_target not in ckpt_embedded:
            pytest.skip(f"{ckpt_target} is not available here (see the warnings for how to add it)")
        return ckpt_embedded[ckpt_target]
    if not request.config.getoption("ckpt_yes") and not open_store(ckpt_target).is_empty():
        raise RefusedError(f"{ckpt_target} is not empty; pass --ckpt-yes to run there anyway")
    return Target(ckpt_target)
