"""Shared fixtures. Tests mirror the package's layers (formats/, disk/, memory/, local/, remote/,
cli/, benchmark/, distributed/); helpers shared by several live in ``tests.checkpoints`` (tensors
of every dtype, written by the one synthetic-checkpoint writer) and ``tests.gguf_files``.

torch is optional: a test that needs it asks for it (``pytest.importorskip``, or the marks in
``tests.devices``), so the numpy-only install runs every other test.
"""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    """weightlift's cache folder is the test session's own: what a benchmark recorded on this
    machine (the fill policy it calibrated, reader counts) must not change a test's outcome."""
    patch = pytest.MonkeyPatch()
    patch.setenv("WEIGHTLIFT_CACHE", str(tmp_path_factory.mktemp("wl-cache")))
    yield
    patch.undo()


@pytest.fixture
def thread_errors(monkeypatch):
    """Exceptions that escaped any thread while the test ran (there must be none)."""
    caught: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: caught.append(f"{a.exc_type.__name__}: {a.exc_value}"))
    return caught


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """weightlift's cache folder (calibrations, reader counts) under the test's own tmp_path."""
    monkeypatch.setenv("WEIGHTLIFT_CACHE", str(tmp_path / "wl-cache"))
    return tmp_path / "wl-cache"
