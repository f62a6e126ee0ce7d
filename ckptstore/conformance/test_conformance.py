"""The conformance suite as collected by ``pytest --pyargs ckptstore.conformance``."""

from __future__ import annotations

import pytest

from ckptstore.conformance.mixins import ConformanceTests


class TestConformance(ConformanceTests):
    """Every layer, on each URL given with --ckpt-url (or on the embedded built-ins)."""

    @pytest.fixture
    def ckpt_url(self, ckpt_checked_url: str) -> str:
        return ckpt_checked_url

    @pytest.fixture
    def ckpt_profile(self, request: pytest.FixtureRequest) -> str:
        return str(request.config.getoption("ckpt_profile"))
