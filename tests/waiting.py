"""Polling for what servers and helper threads do on their own threads; no timing is asserted."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], seconds: float = 10.0) -> None:
    """Poll until ``cond()`` holds; AssertionError if it does not within ``seconds``."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)
