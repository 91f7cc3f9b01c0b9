"""Fixtures the remote tests share."""

from __future__ import annotations

import pytest

from weightlift.remote.server.server import Server


@pytest.fixture
def server():
    """A server on loopback with the default options, closed after the test."""
    with Server() as s:
        yield s
