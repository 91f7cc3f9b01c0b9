"""Lint, format and type checks, run as tests so that the README's one test command runs them.

ruff and mypy come with the ``test`` extra (pinned) and take their settings from pyproject.toml.
Where they are not installed the tests skip, unless ``WEIGHTLIFT_REQUIRE_TOOLS=1`` (CI sets it),
so a CI machine that lost a tool fails instead of passing silently.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tool: str, *args: str) -> None:
    if importlib.util.find_spec(tool) is None:
        if os.environ.get("WEIGHTLIFT_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{tool} is not installed (pip install -e '.[test]')")
        pytest.skip(f"{tool} is not installed (it comes with the test extra)")
    res = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{tool} {' '.join(args)}:\n{res.stdout}{res.stderr}"


def test_ruff_lint() -> None:
    _run("ruff", "check", "--no-cache", "weightlift", "tests", "bench")


def test_ruff_format() -> None:
    _run("ruff", "format", "--check", "--no-cache", "weightlift", "tests", "bench")


def test_mypy() -> None:
    _run("mypy")  # files and settings: [tool.mypy] in pyproject.toml
