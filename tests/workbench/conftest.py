"""Fixtures for the workbench tests: small structures at coarse spacings keep them fast."""

from __future__ import annotations

import pytest

import workbench


@pytest.fixture
def make_wb():
    """Build synchronous workbenches (debounce=0) and close them after the test."""
    made = []

    def make(model="1orc", **settings):
        settings.setdefault("spacing", 1.5)
        settings.setdefault("debounce", 0)
        wb = workbench.Workbench(model, **settings)
        made.append(wb)
        return wb

    yield make
    for wb in made:
        wb.close()
