"""The ``net`` fixture: network namespaces for one test, removed however the test ends."""

from __future__ import annotations

import pytest

from tests.net.netns import Net, unavailable


@pytest.fixture
def net():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    n = Net()
    try:
        yield n
    finally:
        n.close()
