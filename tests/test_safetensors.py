"""The safetensors header parser: golden bytes and one test per validation failure."""

from __future__ import annotations

import json
import struct

import pytest

from weightlift.errors import FormatError
from weightlift.formats.safetensors import MAX_HEADER_SIZE, build_header, header_length, parse_header


def _file(obj: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(obj).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _parse(blob: bytes):
    n = header_length(blob[:8], file="x.safetensors", file_size=len(blob))
    return parse_header(blob[8 : 8 + n], file="x.safetensors", file_size=len(blob))


def test_golden_header_bytes():
    header, offs = build_header([("a", "F32", (2,), 8), ("b", "U8", (3,), 3)], {"k": "v"})
    assert header == (
        b"\x88\x00\x00\x00\x00\x00\x00\x00"
        b'{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}    '
    )
    assert len(header) % 8 == 0 and offs == [0, 8]
    tensors, meta = _parse(header + bytes(11))
    assert meta == {"k": "v"}
    assert [(t.name, t.dtype, t.shape, t.offset, t.length) for t in tensors] == [
        ("a", "F32", (2,), len(header), 8),
        ("b", "U8", (3,), len(header) + 8, 3),
    ]


def test_matches_safetensors_writer(tmp_path):
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    p = tmp_path / "x.safetensors"
    st.save_file({"w": np.zeros((3, 4), np.float16), "z": np.zeros((0,), np.int8)}, str(p), metadata={"a": "b"})
    blob = p.read_bytes()
    tensors, meta = _parse(blob)
    assert meta == {"a": "b"}
    assert {t.name: (t.dtype, t.shape, t.length) for t in tensors} == {"w": ("F16", (3, 4), 24), "z": ("I8", (0,), 0)}


@pytest.mark.parametrize(
    "blob,match",
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", MAX_HEADER_SIZE + 1), "exceeds the limit"),
        (struct.pack("<Q", 100) + b"{}", "runs past the end"),
        (struct.pack("<Q", 3) + b"{x}", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (_file({"a": 5}), "entry is not an object"),
        (_file({"a": {"dtype": "F32", "shape": [1]}}), "lacks data_offsets"),
        (_file({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "unknown dtype"),
        (_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)), "non-negative"),
        (_file({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, bytes(4)), "non-negative"),
        (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "needs 8 bytes"),
        (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4)), "begin, end"),
        (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(2)), "outside the data region"),
        (
            _file(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                bytes(8),
            ),
            "overlap",
        ),
        (_file({"__metadata__": {"k": 1}}), "__metadata__"),
        (_file({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)), "whole number of bytes"),
    ],
)
def test_rejects(blob, match):
    with pytest.raises(FormatError, match=match) as e:
        _parse(blob)
    assert "x.safetensors" in str(e.value)


def test_error_names_tensor():
    blob = _file({"layer.7.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4))
    with pytest.raises(FormatError, match="layer.7.w"):
        _parse(blob)


def test_every_prefix_is_format_error_or_ok():
    header, _ = build_header([("a", "F32", (2,), 8)])
    blob = header + bytes(8)
    for i in range(len(blob)):
        with pytest.raises(FormatError):
            _parse(blob[:i])
    _parse(blob)
