"""The options value and the table of load kinds: every option is classified by every kind, and
every combination a kind refuses is an OptionError that names the option."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import write
from weightlift.api import KINDS, kind_for
from weightlift.errors import OptionError
from weightlift.options import LoadOptions, Placement

# a value other than the default for each option, that asks for nothing else by itself
_SET = {
    "device": "cuda",
    "framework": "torch",
    "select": "w*",
    "dtype": "F16",
    "copy": False,
    "page_cache": "evict",
    "warm": True,
    "threads": 2,
    "engine": "mmap",
    "dequantize": True,
    "profile": True,
    "progress": True,
    "report": {},
    "remote": {"127.0.0.1:1": "w*"},
    "token": "t",
    "streams": 2,
    "shard": object(),
    "group": object(),
    "verify": True,
    "manifest": "m.json",
}
_SELECTORS = {"distributed": {"shard": object()}, "split": {"remote": {"h:1": "*"}}, "verified": {"verify": True}}


def _fields() -> list[str]:
    return [f.name for f in dataclasses.fields(LoadOptions) if f.init]


def test_load_options_mirror_loads_keywords():
    params = inspect.signature(wl.load).parameters
    keywords = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == _fields()
    defaults = {f.name: f.default for f in dataclasses.fields(LoadOptions) if f.init}
    assert {n: params[n].default for n in keywords} == defaults
    assert sorted(_SET) == sorted(keywords)


def test_every_kind_declares_every_option():
    names = set(_fields())
    assert [k.name for k in KINDS][-1] == "local"  # the plain load is the last resort
    for k in KINDS:
        assert k.supports <= names and k.ignores <= names, k.name
        assert not k.supports & k.ignores, k.name
        assert {"device", "framework", "select", "report"} <= k.supports, k.name
    # every option takes effect in some kind
    assert set().union(*(k.supports for k in KINDS)) == names


def _opts(kind: str, name: str) -> LoadOptions:
    kw = dict(_SELECTORS.get(kind, {}))
    kw[name] = _SET[name]
    if name == "device":
        kw["framework"] = "torch"
    return LoadOptions(**kw)


@pytest.mark.parametrize("kind", [k.name for k in KINDS])
def test_every_refused_combination_names_the_option(kind):
    k = next(x for x in KINDS if x.name == kind)
    refused = [n for n in _fields() if n not in k.supports and n not in k.ignores]
    assert refused, f"a {kind} load refuses nothing"
    for name in refused:
        opts = _opts(kind, name)
        picked = next(x for x in KINDS if x.wants(opts))
        if picked.name != kind:
            continue  # the option itself asks for another kind (remote=, shard=...): checked there
        with pytest.raises(OptionError) as e:
            kind_for(opts)
        assert f"{name}=" in str(e.value), (kind, name, str(e.value))
    # and each kind accepts what it supports and ignores
    for name in k.supports | k.ignores:
        opts = _opts(kind, name)
        if next(x for x in KINDS if x.wants(opts)).name == kind:
            assert kind_for(opts) is k


def test_refusals_say_what_the_option_is_for():
    with pytest.raises(OptionError, match=r"manifest= is only used with .*verify=True"):
        kind_for(LoadOptions(manifest="m.json"))
    with pytest.raises(OptionError, match=r"verify=True is not supported together with remote="):
        kind_for(LoadOptions(verify=True, remote={"h:1": "*"}))
    with pytest.raises(OptionError, match=r"dtype= is not supported together with shard= or group="):
        kind_for(LoadOptions(dtype="F16", shard=object()))
    with pytest.raises(OptionError, match=r"remote= is not supported together with shard= or group="):
        kind_for(LoadOptions(group=object(), remote={"h:1": "*"}))
    # off is not set: an empty remote mapping, profile=False
    assert kind_for(LoadOptions(shard=object(), remote={}, profile=False)).name == "distributed"


def test_load_refuses_before_reading(tmp_path):
    path = tmp_path / "m.safetensors"
    write(path, [("w", "F32", (4,), bytes(16))])
    with pytest.raises(OptionError, match="manifest="):
        wl.load(path, manifest=tmp_path / "m.json")
    with pytest.raises(OptionError, match="dequantize="):
        wl.load(path, shard=wl.Shard({"w": 0}, rank=0, world=1), dequantize=True)


def test_values_are_checked_once_when_built():
    for kw, match in (
        ({"engine": "fast"}, "engine"),
        ({"page_cache": "drop"}, "page_cache"),
        ({"threads": 0}, "threads"),
        ({"dtype": "int3"}, "dtype"),
        ({"framework": "jax"}, "framework"),
        ({"device": "cuda"}, "framework='torch'"),
        ({"device": "tpu"}, "unknown device"),
        ({"device": "cudaX", "framework": "torch"}, "unknown device"),
        ({"copy": False, "dtype": "F16"}, "copy=False"),
    ):
        with pytest.raises(OptionError, match=match):
            LoadOptions(**kw)
    o = LoadOptions(dtype=np.float16, threads=3)
    assert o.cast == "F16" and o.threads == 3 and o.placement == Placement()
    assert dataclasses.replace(o, dtype="BF16").cast == "BF16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.copy = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        LoadOptions("cpu")  # type: ignore[misc]  # keyword-only


def test_placement():
    assert Placement().device == "cpu" and not Placement().cuda
    p = Placement(device="cuda:1", framework="torch")
    assert p.cuda and p.index == 1 and Placement(device="cuda", framework="torch").index is None
    with pytest.raises(OptionError, match="framework='torch'"):
        Placement(device="cuda:0")
    with pytest.raises(OptionError, match="framework must be"):
        Placement(framework="jax")
    with pytest.raises(OptionError, match="unknown device"):
        Placement(device="cuda:x", framework="torch")


def test_loads_typed_keywords_are_the_options_fields():
    """LoadKw types what LoadOptions defines: the same names, in the same order (``framework``,
    which picks the result's type, is load's own parameter)."""
    from weightlift.api import LoadKw

    typed = list(LoadKw.__annotations__)
    assert "framework" not in typed and not LoadKw.__required_keys__
    assert ["device", "framework", *typed[1:]] == _fields() and typed[0] == "device"


def test_an_unknown_keyword_is_refused_as_python_refuses_it(tmp_path):
    path = write(tmp_path / "m.safetensors", [("w", "F32", (4,), bytes(16))])
    with pytest.raises(TypeError, match=r"^load\(\) got an unexpected keyword argument 'devce'$"):
        wl.load(path, devce="cpu")  # type: ignore[call-overload]
    for derived in ("placement", "cast"):  # fields of the value, not keywords
        with pytest.raises(TypeError, match=f"'{derived}'"):
            wl.load(path, **{derived: None})  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(__import__("typing"), "get_overloads"), reason="typing.get_overloads is 3.11+")
def test_loads_typed_overloads_keep_its_keywords():
    """The overloads that type load's result by framework take what load takes: the path,
    ``framework`` and the typed keywords."""
    import typing

    import weightlift.api as api

    overloads = typing.get_overloads(api.load)
    assert len(overloads) == 3
    code = api.load.__code__
    for ov in overloads:
        c = ov.__code__
        assert c.co_varnames[: c.co_argcount + c.co_kwonlyargcount + 1] == ("path", "framework", "options")
        assert (c.co_argcount, c.co_kwonlyargcount, c.co_flags & inspect.CO_VARKEYWORDS) == (
            code.co_argcount,
            code.co_kwonlyargcount,
            code.co_flags & inspect.CO_VARKEYWORDS,
        )
        assert ov.__annotations__["options"] == "Unpack[LoadKw]"


_TYPED = """
import weightlift as wl
from weightlift.remote.client import Client

reveal_type(wl.load("m.safetensors", threads=2))
reveal_type(wl.load("m.safetensors", framework="torch", device="cuda:0"))
wl.load("m.safetensors", devce="cpu")
wl.load("m.safetensors", threads="4")
Client("h:1", token="t", streams=2, keep_base=True)
Client("h:1", tokn="t")
Client("h:1", streams="2")
c = Client("h:1")
reveal_type(c.push("m.safetensors", to=["h:2"], verify=True))
c.push("m.safetensors", to=["h:2"], in_place=True)
c.push({}, selct="w*")
"""


def test_a_checker_types_the_keywords(tmp_path):
    """mypy, as a user runs it on their code: load's, Client's and push's keywords are checked by
    name and type, ``framework`` picks load's result type and ``to`` push's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("mypy")
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "user.py").write_text(_TYPED)
    env = {**os.environ, "MYPYPATH": str(root)}  # this tree's weightlift, not an installed one
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", str(tmp_path / "user.py")],
        cwd=root,  # the project's settings: torch is Any there (follow_imports = skip)
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    said: dict[int, str] = {}
    for ln in res.stdout.splitlines():
        _, n, kind, msg = ln.split(":", 3)
        if kind.strip() == "error" or "Revealed" in msg:
            said[int(n)] = said.get(int(n), "") + msg
    out = res.stdout + res.stderr
    assert sorted(said) == [5, 6, 7, 8, 10, 11, 13, 14, 15], out  # lines 9 and 12, right calls, say nothing
    assert said[5].endswith('"dict[str, numpy.ndarray[tuple[Any, ...], numpy.dtype[numpy.generic[Any]]]]"'), out
    assert said[6].endswith('"dict[str, Any]"'), out  # torch.Tensor, which the project's settings skip
    assert 'Unexpected keyword argument "devce"' in said[7] and "[call-overload]" in said[8], out
    assert 'Unexpected keyword argument "tokn"' in said[10], out
    assert 'Argument "streams" to "Client" has incompatible type "str"; expected "int"' in said[11], out
    assert said[13].endswith('"dict[str, weightlift.remote.client.job.PushResult]"'), out
    assert "[call-overload]" in said[14], out  # in_place is for tensors from memory, not with to=
    assert 'Unexpected keyword argument "selct"' in said[15], out


def test_a_token_stays_out_of_the_options_repr():
    token = "a token long enough for the weightlift server 0123456789"
    opts = LoadOptions(token=token)
    assert token not in repr(opts) and "device='cpu'" in repr(opts)
    assert opts.token == token


@pytest.mark.parametrize("dtype", ["I32", "int8", "U8", "BOOL"])
def test_a_cast_to_an_integer_dtype_is_refused(tmp_path, dtype):
    from tests.checkpoints import every_dtype, write
    from weightlift import load
    from weightlift.errors import OptionError

    path = write(tmp_path / "m.safetensors", every_dtype())
    with pytest.raises(OptionError, match="floating-point"):
        load(path, dtype=dtype)


def test_a_device_is_checked_once_and_travels_as_a_placement():
    """Below the calls that take a device string from a caller, a device travels as the checked
    Placement: nothing builds one again from its string, or tests the string for "cuda". The
    tensor server checks its device in ``configure`` and carries ``ServerConfig.placement``."""
    import ast
    from pathlib import Path

    pkg = Path(wl.__file__).resolve().parent
    entries = {
        "Placement": {
            "options.py",
            "distributed/fanout.py",
            "remote/server/config.py",
        },  # load's options; broadcast_load's keywords; the server's
        "make_target": set(),  # the string form, for callers that hold no Placement
        "startswith": {"options.py", "benchmark/arms.py"},  # the check itself; a benchmark arm's keywords
    }
    found: dict[str, set[str]] = {name: set() for name in entries}
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg).as_posix()
        if rel == "memory/targets.py":  # targets: make_target itself
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name == "startswith" and not any(
                isinstance(a, ast.Constant) and str(a.value).startswith("cuda") for a in node.args
            ):
                continue
            if name == "Placement" and not (node.args or node.keywords):
                continue  # the default, host memory: nothing to parse
            if name in found:
                found[name].add(rel)
    assert found == entries
