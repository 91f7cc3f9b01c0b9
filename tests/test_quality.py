"""Lint, format and type checks, run as tests so that the README's one test command runs them.

ruff and mypy come with the ``test`` extra (pinned) and take their settings from pyproject.toml.
Where they are not installed the tests skip, unless ``WEIGHTLIFT_REQUIRE_TOOLS=1`` (CI sets it),
so a CI machine that lost a tool fails instead of passing silently.
"""

from __future__ import annotations

import ast
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


# Seams, not sizes: a module is as long as its one concern needs. What a bad cut leaves behind is
# a module that leans on many of its siblings, or the same helper written out twice.

#: Sibling modules (same package) one module may import from.
MAX_SIBLINGS = 6
#: Modules over MAX_SIBLINGS today, pinned at their count so that it only goes down.
SIBLING_EXCEPTIONS = {
    "weightlift/api.py": 7,
}
#: A definition shorter than this (its AST dump, in characters) is too small to call a copy.
MIN_DUPLICATE = 200


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted((ROOT / "weightlift").rglob("*.py"))]


def _siblings(path: Path, tree: ast.Module) -> set[str]:
    """The modules of ``path``'s own package that it imports from (relative or absolute)."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = ".".join(rel.parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                out.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif node.level == 0 and node.module and node.module.startswith(package + "."):
                out.add(node.module[len(package) + 1 :].split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name[len(package) + 1 :].split(".")[0] for a in node.names if a.name.startswith(package + "."))
    out.discard(rel.name)
    return out


def _facade(path: Path, tree: ast.Module) -> bool:
    """A package's ``__init__`` that only gathers its public names (imports, ``__all__``, a
    docstring): importing every sibling is its job, not a tangle."""
    if path.name != "__init__.py":
        return False
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.dump(node):
            continue
        if (
            isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.dump(node.test)
            and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)
        ):  # imports for the type checker only
            continue
        return False
    return True


def test_sibling_imports() -> None:
    bad = []
    for path, tree in _modules():
        rel = str(path.relative_to(ROOT))
        if _facade(path, tree):
            continue
        n = len(_siblings(path, tree))
        limit = SIBLING_EXCEPTIONS.get(rel, MAX_SIBLINGS)
        if n > limit:
            bad.append(f"{rel} imports {n} sibling modules (limit {limit}): {sorted(_siblings(path, tree))}")
    assert not bad, "\n".join(bad)


def test_sibling_exceptions_are_current() -> None:
    """An exception that no longer applies is dropped, so the limit tightens as the code improves."""
    counts = {str(p.relative_to(ROOT)): len(_siblings(p, t)) for p, t in _modules()}
    stale = {k: (v, counts.get(k)) for k, v in SIBLING_EXCEPTIONS.items() if counts.get(k, 0) < v}
    assert not stale, f"lower or drop these exceptions (pinned, now): {stale}"


def _body_key(node: ast.AST) -> str:
    body = list(getattr(node, "body", []))
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring may differ between copies
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def test_no_helper_written_twice() -> None:
    """The same top-level function or class body in two modules is one helper that wants one home."""
    seen: dict[str, list[str]] = {}
    for path, tree in _modules():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                key = _body_key(node)
                if len(key) >= MIN_DUPLICATE:
                    seen.setdefault(key, []).append(f"{path.relative_to(ROOT)}:{node.name}")
    copies = [places for places in seen.values() if len(places) > 1]
    assert not copies, "\n".join(", ".join(c) for c in copies)
