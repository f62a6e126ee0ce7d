"""The conformance suite as collected by ``pytest --pyargs ckptstore.conformance``."""

from __future__ import annotations

from typing import Any

import pytest

from ckptstore.conformance.mixins import ConformanceTests


class TestConformance(ConformanceTests):
    """Every layer, on each URL given with --ckpt-url (or on the embedded built-ins)."""

    @pytest.fixture
    def ckpt_url(self, ckpt_checked_target: Any) -> str:
        return str(ckpt_checked_target.url)

    @pytest.fixture
    def ckpt_options(self, ckpt_checked_target: Any) -> dict[str, Any]:
        return dict(ckpt_checked_target.options)

    @pytest.fixture
    def ckpt_profile(self, request: pytest.FixtureRequest) -> str:
        return str(request.config.getoption("ckpt_profile"))
