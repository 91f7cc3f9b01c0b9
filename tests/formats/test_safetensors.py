"""The safetensors header parser: golden bytes and one test per validation failure."""

from __future__ import annotations

import json
import struct

import numpy as np
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


# ---- agreement with the reference parser (safetensors.deserialize) ----

F32_1 = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


def _raw(header: str | bytes, data: bytes = b"") -> bytes:
    """A file whose header is exactly these bytes (no re-encoding by json.dumps)."""
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw)) + raw + data


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _with_field(field: str) -> bytes:
    """One F32 tensor whose entry has one more field, as raw JSON text."""
    return _raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + field + "}}", bytes(4))


def _reference(blob: bytes):
    """The reference parser's tensors ({name: (dtype, shape)}), or None where it refuses."""
    safetensors = pytest.importorskip("safetensors")
    try:
        return {n: (v["dtype"], tuple(v["shape"])) for n, v in safetensors.deserialize(blob)}
    except safetensors.SafetensorError:
        return None


REFUSED_LIKE_THE_REFERENCE = {
    "bytes after the last tensor": (_raw('{"a":' + F32_1 + "}", bytes(5)), "1 byte follows the last tensor, 'a'"),
    "bytes and no tensor": (_raw("{}", bytes(3)), "3 bytes follow the header"),
    "a gap between tensors": (
        _file({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, bytes(12)),
        "tensor 'b': data_offsets begin at 8, leaving a gap of 4 bytes after the end of tensor 'a'",
    ),
    "first tensor not at 0": (_file({"a": _entry("F32", [1], 4, 8)}, bytes(8)), "tensor 'a': .* gap of 4 bytes"),
    "an empty tensor after the end": (
        _file({"a": _entry("F32", [1], 0, 4), "e": _entry("F32", [0], 8, 8)}, bytes(8)),
        "tensor 'e': .* gap",
    ),
    "an empty tensor inside another": (
        _file({"a": _entry("F32", [2], 0, 8), "e": _entry("F32", [0], 4, 4)}, bytes(8)),
        "tensor 'e': bytes overlap: .* inside tensor 'a'",
    ),
    "__metadata__ twice": (_raw('{"__metadata__":{},"__metadata__":{}}'), "__metadata__ appears twice"),
    "a field twice": (
        _raw('{"a":{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}}', bytes(4)),
        "tensor 'a': entry has shape twice",
    ),
    "NaN": (_with_field("NaN"), "NaN is not JSON"),
    "Infinity": (_raw('{"__metadata__":{"k":Infinity}}'), "Infinity is not JSON"),
    "-Infinity": (_with_field("[-Infinity]"), "-Infinity is not JSON"),
    "a float past a double's range": (_with_field("1e400"), "out of range"),
    "an integer past a double's range": (_with_field("1" + "0" * 400), "tensor 'a': .* out of range"),
    "-0 as an offset": (_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}', bytes(4)), "begin, end"),
    "2**64 as a dimension": (_file({"a": _entry("U8", [2**64], 0, 4)}, bytes(4)), "non-negative integers"),
    "a UTF-8 byte-order mark": (_raw(b"\xef\xbb\xbf{}"), "BOM"),
    "UTF-16 with a byte-order mark": (_raw("{}".encode("utf-16")), "not valid UTF-8"),
    "UTF-16 without one": (_raw("{}".encode("utf-16-le")), "not valid JSON"),
    "UTF-32": (_raw("{}".encode("utf-32")), "not valid UTF-8"),
    "a lone surrogate in a name": (_raw('{"\\ud800":' + F32_1 + "}", bytes(4)), "tensor '\\\\ud800': .*surrogate"),
    "a lone low surrogate in a name": (_raw('{"a\\udc00":' + F32_1 + "}", bytes(4)), "surrogate"),
    "a lone surrogate in metadata": (_raw('{"__metadata__":{"k":"\\ud83d"}}'), "__metadata__ value .* surrogate"),
    "a lone surrogate in a metadata key": (_raw('{"__metadata__":{"\\ud83d":"v"}}'), "__metadata__ key .* surrogate"),
    "a lone surrogate in an unread field": (_with_field('["\\udfff"]'), "tensor 'a': .* surrogate"),
    "a lone surrogate in an unread key": (_with_field('{"\\ud800":1}'), "tensor 'a': .* surrogate"),
    "nesting 128 deep": (_with_field("[" * 126 + "]" * 126), "tensor 'a': header nests deeper than 127"),
}

ACCEPTED_LIKE_THE_REFERENCE = {
    "a surrogate pair": _raw('{"\\ud83d\\ude00":' + F32_1 + "}", bytes(4)),
    "a null __metadata__": _raw('{"__metadata__":null,"a":' + F32_1 + "}", bytes(4)),
    "fields the format does not define": _with_field('{"k":1,"k":[-0,1e300,12345678901234567890123]}'),
    "nesting 127 deep": _with_field("[" * 125 + "]" * 125),
    "empty tensors sharing an offset": _file(
        {
            "e": _entry("F32", [0], 4, 4),
            "f": _entry("I8", [3, 0], 4, 4),
            "a": _entry("F32", [1], 0, 4),
            "z": _entry("U8", [0], 0, 0),
        },
        bytes(4),
    ),
    "only empty tensors": _file({"e": _entry("F32", [0, 2**31], 0, 0)}),
    "whitespace around the JSON": _raw(" \n\t{}\r\n "),
    "control characters in a name": _raw('{"a\\u0000\\u001b[2J\\n":' + F32_1 + "}", bytes(4)),
    "64 dimensions": _file({"a": _entry("F32", [1] * 64, 0, 4)}, bytes(4)),
}

# The reference accepts these; we refuse them on purpose (see the parser's docstring).
REFUSED_ON_PURPOSE = {
    "a tensor name twice": (
        _raw('{"a":' + F32_1 + ',"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
        "tensor 'a': tensor name appears twice",
    ),
    "a metadata key twice": (_raw('{"__metadata__":{"k":"v","k":"w"}}'), "__metadata__ key 'k' appears twice"),
    "an empty tensor with a dimension of 2**62": (
        _file({"a": _entry("F32", [0, 2**62], 0, 0)}),
        "tensor 'a': shape \\[0, 4611686018427387904\\] is too large",
    ),
    "an empty tensor with 2**62 behind the zero": (
        _file({"a": _entry("U8", [2**62, 0], 0, 0)}),
        "tensor 'a': .*too large",
    ),
    "an empty tensor just past the extent": (_file({"a": _entry("U8", [0, 2**30, 2**30], 0, 0)}), "too large"),
    "65 dimensions": (_file({"a": _entry("F32", [1] * 65, 0, 4)}, bytes(4)), "tensor 'a': shape has 65 dimensions"),
}


@pytest.mark.parametrize("blob,match", REFUSED_LIKE_THE_REFERENCE.values(), ids=REFUSED_LIKE_THE_REFERENCE)
def test_refused_like_the_reference(blob, match):
    with pytest.raises(FormatError, match=match) as e:
        _parse(blob)
    assert e.value.file == "x.safetensors"
    assert _reference(blob) is None


@pytest.mark.parametrize("blob", ACCEPTED_LIKE_THE_REFERENCE.values(), ids=ACCEPTED_LIKE_THE_REFERENCE)
def test_accepted_like_the_reference(blob):
    tensors, _ = _parse(blob)
    assert {t.name: (t.dtype, t.shape) for t in tensors} == _reference(blob)


@pytest.mark.parametrize("blob,match", REFUSED_ON_PURPOSE.values(), ids=REFUSED_ON_PURPOSE)
def test_refused_on_purpose(blob, match):
    with pytest.raises(FormatError, match=match):
        _parse(blob)
    assert _reference(blob) is not None


def test_the_last_of_repeated_keys_is_what_the_reference_keeps():
    # Why a repeated name is refused: the reference reads this file as one F32 (2,), a reader
    # that keeps the first key would read F32 (1,) and four stray bytes.
    blob = REFUSED_ON_PURPOSE["a tensor name twice"][0]
    assert _reference(blob) == {"a": ("F32", (2,))}


def test_header_length_limit_is_the_references():
    assert MAX_HEADER_SIZE == 100_000_000
    assert header_length(struct.pack("<Q", MAX_HEADER_SIZE), file="x", file_size=2**40) == MAX_HEADER_SIZE
    for n in (MAX_HEADER_SIZE + 1, 100 * 1024 * 1024):
        with pytest.raises(FormatError, match="exceeds the limit of 100000000"):
            header_length(struct.pack("<Q", n), file="x", file_size=2**40)
    safetensors = pytest.importorskip("safetensors")
    for n, why in ((MAX_HEADER_SIZE, "invalid header length"), (MAX_HEADER_SIZE + 1, "header too large")):
        with pytest.raises(safetensors.SafetensorError, match=why):
            safetensors.deserialize(struct.pack("<Q", n))


# ---- what the parser accepts, a load can return ----


def _write(path, blob: bytes):
    path.write_bytes(blob)
    return path


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_empty_tensors_at_the_extent_limit_load(tmp_path, framework):
    import weightlift as wl
    from weightlift.formats import MAX_EXTENT

    if framework == "torch":
        pytest.importorskip("torch")
    shapes = {"a": [0, MAX_EXTENT], "b": [MAX_EXTENT, 0], "c": [3, 0, MAX_EXTENT // 3]}
    for dtype in ("F64", "C64", "BF16", "U8", "F4"):
        path = _write(tmp_path / f"{dtype}.safetensors", _file({n: _entry(dtype, s, 0, 0) for n, s in shapes.items()}))
        for kw in ({}, {"copy": False}, {"dtype": "F64"}):
            if dtype == "F4" and "dtype" in kw:
                continue  # packed types are not cast
            out = wl.load(path, framework=framework, **kw)
            if dtype != "F4":  # packed types come back as their (no) bytes
                assert {n: list(v.shape) for n, v in out.items()} == shapes, (dtype, kw)
    too_big = _write(tmp_path / "big.safetensors", _file({"a": _entry("F64", [0, MAX_EXTENT + 1], 0, 0)}))
    with pytest.raises(FormatError, match="big.safetensors: tensor 'a': .* too large"):
        wl.open(too_big)


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16", "F64", "F8_E4M3"])
def test_a_cast_of_an_empty_tensor_loads(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    import weightlift as wl

    path = _write(tmp_path / "e.safetensors", _file({"e": _entry(dtype, [0, 3], 0, 0), "f": _entry(dtype, [0], 0, 0)}))
    for framework in ("torch", "numpy"):
        out = wl.load(path, framework=framework, dtype="F16")
        assert [tuple(v.shape) for v in out.values()] == [(0, 3), (0,)]
        assert all(v.dtype == (torch.float16 if framework == "torch" else np.float16) for v in out.values())


def test_inspect_shows_any_name_on_one_line(tmp_path, capsys):
    from weightlift.cli import main

    blob = _raw(
        '{"a\\u001b[2J\\nb":' + F32_1 + ',"\\u00e9\\ud83d\\ude00":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}}',
        bytes(4),
    )
    assert main(["inspect", str(_write(tmp_path / "names.safetensors", blob))]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "a\\x1b[2J\\nb " in out
    assert "é😀" in out
    assert len(out.splitlines()) == 4


def test_inspect_of_a_lone_surrogate_is_a_format_error(tmp_path, capsys):
    from weightlift.cli import main

    path = _write(tmp_path / "s.safetensors", _raw('{"\\ud800":' + F32_1 + "}", bytes(4)))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "s.safetensors: tensor '\\ud800'" in err and "surrogate" in err


def test_build_header_refuses_a_header_the_reader_refuses():
    # each entry is 100,000 bytes of JSON (its name, quotes and fields): 1000 of them, the braces
    # and the padding pass the limit by 8 bytes, 999 stay under it
    entries = [(f"{i:04d}" + "x" * 99_945, "U8", (0,), 0) for i in range(1000)]
    with pytest.raises(
        FormatError, match=f"of 1000 tensors would be 100000008 bytes, which exceeds the limit of {MAX_HEADER_SIZE}"
    ) as e:
        build_header(entries, file="out.safetensors")
    assert e.value.file == "out.safetensors"
    fits = entries[:999]
    header, _ = build_header(fits)
    assert header_length(header[:8], file="x", file_size=len(header)) == len(header) - 8 <= MAX_HEADER_SIZE
