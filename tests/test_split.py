"""Split loads over real loopback sockets: the local part here, the remote parts on servers."""

from __future__ import annotations

import pytest

import weightlift as wl
from tests.checkpoints import every_dtype, raw_bytes, write
from weightlift.errors import NotFoundError, OptionError
from weightlift.split import parse_remote


def test_parse_remote():
    assert parse_remote(["h:1=a.*", "h:1=b", "g:2=c"]) == {"h:1": ["a.*", "b"], "g:2": ["c"]}
    for bad in ("h:1", "h=a", "h:1="):
        with pytest.raises(OptionError):
            parse_remote([bad])


def test_split_load_bytes_and_report(tmp_path):
    tensors = every_dtype()
    path = write(tmp_path / "m.safetensors", tensors)
    remote_names = {"t.f32", "t.bf16", "t.i64", "t.u8"}
    with wl.Server(port=0) as a, wl.Server(port=0) as b:
        ha, pa = a.start()
        hb, pb = b.start()
        rep: dict = {}
        local = wl.load(
            path,
            remote={f"{ha}:{pa}": ["t.f32", "t.bf16"], f"{hb}:{pb}": "re:^t\\.(i64|u8)$"},
            report=rep,
        )
        got_a, got_b = a.tensors(), b.tensors()
    assert set(local) == {t[0] for t in tensors} - remote_names
    assert set(got_a) == {"t.f32", "t.bf16"} and set(got_b) == {"t.i64", "t.u8"}
    for name, _, _, raw in tensors:
        src = local.get(name, got_a.get(name, got_b.get(name)))
        assert raw_bytes(src) == raw, name
    assert rep["remote"][f"{ha}:{pa}"]["tensors"] == 2
    assert rep["seconds"] > 0


def test_split_remote_selection_matching_nothing(tmp_path):
    path = write(tmp_path / "m.safetensors", every_dtype())
    with pytest.raises(NotFoundError, match="matches no tensor"):
        wl.load(path, remote={"127.0.0.1:1": "nothing.*"})
