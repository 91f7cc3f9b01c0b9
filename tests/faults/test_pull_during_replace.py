"""A pull while another client replaces a tensor: the file holds each tensor as some version was,
whole, with that version's dtype and shape, or the pull fails with a clear error.

A pull lists the tensors, then reads each by name. A tensor replaced in between by one of
another size or shape used to be read against the listing: a larger replacement came back as
the prefix of the new bytes under the old shape, with no error (the soak, bench/soak.py, found
it). Since protocol 1.2 LIST states each tensor's version and READ asks for the version listed;
the server answers STALE for a replaced one, and the pull starts over.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import write
from tests.faults.support import hex_digest, source_bytes
from weightlift.errors import WeightliftError
from weightlift.remote.client import pull
from weightlift.remote.client.client import Client
from weightlift.remote.server.server import Server

CASES = {
    "grows": ((1000,), (2000,)),  # the listing's length is a prefix of the new bytes
    "same size, new shape": ((2, 6), (3, 4)),  # every byte is the new version's, under the old shape
}


def _ckpt(path: Path, shape: tuple[int, ...], seed: int) -> Path:
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return write(path, [("w", "F32", shape, data.tobytes())])


def _header(path: Path) -> tuple[str, list[int]]:
    import json

    raw = path.read_bytes()
    h = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return h["w"]["dtype"], h["w"]["shape"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_tensor_replaced_between_list_and_read_is_pulled_whole_or_refused(tmp_path, case, monkeypatch):
    old_shape, new_shape = CASES[case]
    old = _ckpt(tmp_path / "old.safetensors", old_shape, 1)
    new = _ckpt(tmp_path / "new.safetensors", new_shape, 2)
    versions = {
        (tuple(old_shape), hex_digest(source_bytes(old)["w"])),
        (tuple(new_shape), hex_digest(source_bytes(new)["w"])),
    }
    out = tmp_path / "pulled.safetensors"
    replaced = []
    with Server() as server, Client(server.address) as writer, Client(server.address) as reader:
        writer.push(old)
        real = pull.listing

        def list_then_replace(conn):
            entries = real(conn)
            if not replaced:  # the pull's first LIST: the new version lands before its READs
                writer.push(new)
                replaced.append(entries)
            return entries

        monkeypatch.setattr(pull, "listing", list_then_replace)
        try:
            reader.pull(out)
        except WeightliftError:
            return  # refused, clearly: a correct outcome
    assert replaced and replaced[0][0].shape == tuple(old_shape)  # the race did happen
    dtype, shape = _header(out)
    assert dtype == "F32"
    assert (tuple(shape), hex_digest(source_bytes(out)["w"])) in versions, (
        "the pulled tensor is no version that was pushed"
    )


def test_a_read_of_a_replaced_version_is_refused_as_stale(tmp_path):
    """READ names the version LIST stated: the current one is served, a replaced one is refused
    with STALE (never the new bytes), and a READ naming no version gets whatever is there. The
    same bytes pushed again to a caching server are the same version (a listing stays good)."""
    from tests.remote.test_server import Raw
    from weightlift.digest.blake import HASH_THRESHOLD
    from weightlift.remote.protocol import Error, ErrorCode, ListRequest, Read, ReadReply

    n = HASH_THRESHOLD // 4  # named by digest: a second push finds it in memory
    a = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    b = np.random.default_rng(2).standard_normal(2 * n).astype(np.float32)
    path_a = write(tmp_path / "a.safetensors", [("w", "F32", (n,), a.tobytes())])
    path_b = write(tmp_path / "b.safetensors", [("w", "F32", (2 * n,), b.tobytes())])
    with Server(cache_dir=str(tmp_path / "cache")) as server, Client(server.address) as writer:
        writer.push(path_a)
        raw = Raw(server.address)
        raw.hello()
        raw.send(ListRequest())
        (entry,) = raw.recv().entries
        assert entry.version > 0
        raw.send(Read("w", 0, 16, 0, entry.version))
        assert raw.recv() == ReadReply(16) and raw.read_payload(16) == a.tobytes()[:16]
        writer.push(path_a)
        raw.send(ListRequest())
        assert raw.recv().entries[0].version == entry.version
        writer.push(path_b)
        raw.send(Read("w", 0, 16, 0, entry.version))
        reply = raw.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.STALE
        raw.send(Read("w", 0, 16))
        assert raw.recv() == ReadReply(16) and raw.read_payload(16) == b.tobytes()[:16]
        raw.send(ListRequest())
        assert raw.recv().entries[0].version > entry.version
        raw.close()
