"""The package's layering, checked from its source: folders are layers, and imports go downward.

Read with ``ast`` (nothing is imported), every import of a weightlift module is an edge from the
importing module's component (its top-level module or folder) to the imported one's. The rules:

* an edge goes to a lower rank, or stays within one component: ``local`` and ``remote`` share a
  rank, so neither imports the other; nothing imports the CLI or the benchmark (the CLI may run
  the benchmark);
* no module imports another module's private name (``from x import _y``);
* the imports made when a module loads (not those inside functions) form no cycle, and neither
  do they together with those under TYPE_CHECKING (a type checker follows those too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "weightlift"

RANK = {
    "errors": 0,
    "dtypes": 1,
    "env": 1,
    "libc": 1,
    "progress": 1,
    "profile": 2,
    "formats": 2,
    "options": 3,
    "plan": 3,
    "disk": 4,
    "memory": 4,
    "sources": 4.5,  # beside disk, over memory (it lands bytes in targets), under checkpoint
    "checkpoint": 5,
    "digest": 6,
    "local": 7,
    "remote": 7,
    "split": 8,
    "distributed": 8,
    "api": 9,
    "hf": 10,
    "integrations": 11,
    "check": 12,
    "benchmark": 13,
    "cli": 14,
    "__init__": 15,
    "__main__": 15,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = ["weightlift", *path.relative_to(PKG).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(module: str, name: str) -> str:
    """``from module import name``: the submodule if ``name`` is one, else ``module`` itself."""
    sub = f"{module}.{name}"
    return sub if sub in MODULES else module


LOAD, TYPING, CALL = "load", "typing", "call"  # when an import runs: module load, type checking, a call


def _imports(module: str, path: Path) -> Iterator[tuple[str, list[str], str]]:
    """(imported module, names taken from it, when it runs: LOAD, TYPING or CALL) per import."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(node: ast.AST, at_load: str) -> Iterator[tuple[str, list[str], str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, CALL)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(child, TYPING if at_load == LOAD else at_load)
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == "weightlift":
                        yield a.name, [], at_load
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                if src.split(".")[0] != "weightlift":
                    continue
                for a in child.names:
                    target = _resolve(src, a.name)
                    yield target, ([] if target != src else [a.name]), at_load
            else:
                yield from walk(child, at_load)

    yield from walk(tree, LOAD)


def test_layers_import_downward() -> None:
    bad = []
    for module, path in MODULES.items():
        mine = _component(module)
        assert mine in RANK, f"{module}: component {mine!r} has no rank in this test"
        for target, names, _ in _imports(module, path):
            theirs = _component(target)
            if theirs == mine:
                continue
            if theirs == "__init__" and names == ["__version__"]:
                continue  # the version string, read by the CLI
            if RANK[theirs] >= RANK[mine]:
                bad.append(f"{module} imports {target} ({mine} -> {theirs})")
    assert not bad, "\n".join(bad)


def test_no_private_names_cross_modules() -> None:
    bad = [
        f"{module} imports {name} from {target}"
        for module, path in MODULES.items()
        for target, names, _ in _imports(module, path)
        for name in names
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not bad, "\n".join(bad)


def _cycle(when: set[str]) -> list[str] | None:
    """An import cycle among the imports that run ``when``, or None."""
    graph = {m: {t for t, _, w in _imports(m, p) if w in when and t in MODULES and t != m} for m, p in MODULES.items()}
    # a package's __init__ runs before its submodules load: an edge to a package is an edge to it
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        seen[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if seen.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in seen and (found := visit(t)) is not None:
                return found
        stack.pop()
        seen[m] = 2
        return None

    for m in sorted(graph):
        if m not in seen and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycles_at_load() -> None:
    cycle = _cycle({LOAD})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_for_type_checkers() -> None:
    cycle = _cycle({LOAD, TYPING})
    assert cycle is None, "import cycle under TYPE_CHECKING: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_type_checking_imports() -> None:
    """The check itself: an import under TYPE_CHECKING is an edge for type checkers, not at load."""
    whens = {w for t, _, w in _imports("weightlift", MODULES["weightlift"]) if t == "weightlift.remote.server"}
    assert whens == {TYPING, CALL}  # the lazy Server: visible to type checkers, loaded on first use


# The server's layout: one entry per concern, drawn as one table in docs/design.md ("The server's
# layout"). A module added, merged or renamed changes this pin, the table and the design together.
SERVER = PKG / "remote" / "server"
SERVER_LAYOUT = {
    "__init__.py": "Server, loaded on first use",
    "server.py": "the public Server",
    "config.py": "settings",
    "admission.py": "admission",
    "connection.py": "one connection and its frames",
    "receive.py": "receiving into destinations",
    "reads.py": "reads",
    "updates": "updates",
    "store.py": "the store",
    "cache": "the disk cache",
    "stats.py": "observation",
    "relay.py": "relayed pushes",
}
#: The server modules one WRITE crosses, from the frame reader to the store: the frames are
#: decoded by the protocol package, and with a cache (or VERIFY) the bytes are hashed on the way.
WRITE_PATH = {"connection", "receive", "store", "cache"}


def _server_imports(module: str) -> set[str]:
    """The server's entries (top-level modules or subpackages) ``module`` imports at load."""
    prefix = "weightlift.remote.server."
    out = set()
    for target, _, when in _imports(module, MODULES[module]):
        if when == LOAD and target.startswith(prefix):
            out.add(target[len(prefix) :].split(".")[0])
    out.discard(module.rpartition(".")[2])
    return out


def test_the_server_is_laid_out_as_the_design_draws_it() -> None:
    entries = {p.name for p in SERVER.iterdir() if p.name != "__pycache__" and not p.name.startswith(".")}
    assert entries == set(SERVER_LAYOUT)
    design = (PKG.parent / "docs" / "design.md").read_text()
    table = design.split("### The server's layout", 1)[1].split("\n\n", 2)[1]
    drawn = {row.split("|")[1].strip().strip("`") for row in table.splitlines()[2:]}
    assert drawn == {e.removesuffix(".py") + ("/" if (SERVER / e).is_dir() else "") for e in SERVER_LAYOUT}


def test_a_write_crosses_only_the_modules_the_design_names() -> None:
    """From the connection down, a WRITE reaches the receiver, the cache's hashing and writer,
    and the store: receive.py imports nothing else of the server besides the admission's
    Context it is handed."""
    assert {"receive", "store"} <= _server_imports("weightlift.remote.server.connection")
    assert _server_imports("weightlift.remote.server.receive") <= WRITE_PATH | {"admission"}
    for cache_module in ("weightlift.remote.server.cache", "weightlift.remote.server.cache.hashing"):
        assert _server_imports(cache_module) <= {"cache"}, cache_module
    assert _server_imports("weightlift.remote.server.store") <= {"updates"}  # the gates of in-place commits


def test_the_server_hashes_in_one_place() -> None:
    """Every hash the server takes goes through cache/hashing.py: no other server module calls
    blake3 or the digest layer's hash_buffer itself."""
    hashing = SERVER / "cache" / "hashing.py"
    for path in sorted(SERVER.rglob("*.py")):
        if path == hashing:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name != "blake3" for a in node.names), path
            elif isinstance(node, ast.ImportFrom) and node.module in ("blake3", "weightlift.digest.blake"):
                assert all(a.name != "hash_buffer" for a in node.names) and node.module != "blake3", path


def test_no_server_class_is_defined_twice() -> None:
    seen: dict[str, Path] = {}
    for path in sorted(SERVER.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                assert node.name not in seen, f"{node.name} in {seen[node.name]} and {path}"
                seen[node.name] = path
