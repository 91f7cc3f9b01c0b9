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


# Size limits for the installed package: a module holds one concern, a class one object, a
# function one step. Measured in source lines (a docstring counts: it is part of what a reader reads).
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def _oversized() -> list[str]:
    import ast

    bad = []
    for path in sorted((ROOT / "weightlift").rglob("*.py")):
        rel = path.relative_to(ROOT)
        text = path.read_text()
        n = text.count("\n")
        if n > MAX_FILE_LINES:
            bad.append(f"{rel}: {n} lines (limit {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                if size > limit:
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    bad.append(f"{rel}:{node.lineno}: {kind} {node.name} is {size} lines (limit {limit})")
    return bad


def test_sizes() -> None:
    bad = _oversized()
    assert not bad, "\n".join(bad)
