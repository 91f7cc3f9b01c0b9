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


@pytest.mark.skipif(not hasattr(__import__("typing"), "get_overloads"), reason="typing.get_overloads is 3.11+")
def test_loads_typed_overloads_keep_its_keywords():
    """The overloads that type load's result by framework take exactly load's keywords."""
    import typing

    import weightlift.api as api

    overloads = typing.get_overloads(api.load)
    assert len(overloads) == 3
    impl = inspect.signature(api.load).parameters
    for ov in overloads:
        params = inspect.signature(ov).parameters
        assert list(params) == list(impl)
        assert [p.kind for p in params.values()] == [p.kind for p in impl.values()]


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
