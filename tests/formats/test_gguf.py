"""GGUF header parser: cross-checked against gguf.GGUFReader, golden bytes, and every refusal."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGUFEndian
from gguf.constants import GGMLQuantizationType as Q
from gguf.constants import GGUFValueType as V
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize

from tests.gguf_files import SAMPLE_METADATA, kv_str, kv_u32, pack, s, tensor_info, write_sample
from weightlift.errors import FormatError, OptionError
from weightlift.formats import TensorInfo
from weightlift.formats.gguf import (
    MAX_ARRAY,
    MAX_DIMS,
    MAX_KV,
    MAX_NESTING,
    MAX_STRING,
    MAX_TENSORS,
    GGUFHeader,
    Split,
    Truncated,
    dequantize,
    numpy_dtype_and_shape,
    parse_gguf,
    split_name,
    split_of,
    split_parts,
)

F32 = int(Q.F32)


def parse(data: bytes, *, file: str = "m.gguf", file_size: int | None = None) -> GGUFHeader:
    return parse_gguf(data, file=file, file_size=len(data) if file_size is None else file_size)


def refused(data: bytes, match: str, *, tensor: str | None = None, file_size: int | None = None) -> FormatError:
    with pytest.raises(FormatError, match=match) as e:
        parse(data, file_size=file_size)
    assert e.value.file == "m.gguf"
    assert e.value.tensor == tensor
    return e.value


def header_with(*kvs: bytes, tensors: tuple[bytes, ...] = (), data: bytes = b"", **kw: int) -> bytes:
    return pack([kv_str("general.architecture", "x"), *kvs], list(tensors), data=data, **kw)


# ---- cross-checks against gguf.GGUFReader on real files ----


def cross_check(path: Path, header: GGUFHeader) -> None:
    reader = GGUFReader(path)
    raw = path.read_bytes()
    assert header.data_start == reader.data_offset
    assert header.alignment == reader.alignment
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for t, rt in zip(header.tensors, reader.tensors, strict=False):
        assert t.offset == rt.data_offset
        assert t.length == rt.n_bytes == rt.data.nbytes
        assert t.ggml_type == int(rt.tensor_type)
        assert t.shape == tuple(reversed(rt.shape.tolist()))
        assert t.alignment == header.alignment
        assert t.file == str(path)
        assert raw[t.offset : t.end] == rt.data.tobytes()
        dtype, shape = numpy_dtype_and_shape(t)
        assert (dtype, shape) == (rt.data.dtype, rt.data.shape)
        assert tuple(t.extra["raw_shape"]) == rt.data.shape or dtype != np.uint8
        view = np.frombuffer(raw, dtype=dtype, count=t.length // dtype.itemsize, offset=t.offset).reshape(shape)
        np.testing.assert_array_equal(view, rt.data)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        ours = header.metadata[key]
        flat = [x for sub in ours for x in sub] if key == "test.nested" else ours
        assert flat == field.contents(), key
    assert set(header.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}


def test_sample_file_matches_reader_and_writer(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    written = write_sample(path)
    data = path.read_bytes()
    header = parse_gguf(data, file=str(path), file_size=len(data))
    assert header.version == 3 and header.alignment == 32
    cross_check(path, header)
    assert header.metadata["general.architecture"] == "llama"
    for key, (_vtype, _sub, value) in SAMPLE_METADATA.items():
        assert header.metadata[key] == value, key
        assert type(header.metadata[key]) is type(value), key
    plain = {Q.F32, Q.F16, Q.BF16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64}
    for t in header.tensors:
        qtype, arr = written[t.name]
        assert t.dtype == qtype.name  # the safetensors names of the plain types are ggml's too
        assert t.quantized == (qtype not in plain)
        assert data[t.offset : t.end] == arr.tobytes()
        if not t.quantized and qtype != Q.BF16:
            assert t.shape == arr.shape
    by_name = {t.name: t for t in header.tensors}
    assert by_name["blk.0.ffn_down.weight"].shape == (2, 512)
    assert by_name["blk.0.ffn_down.weight"].extra["raw_shape"] == (2, 2 * 144)
    assert by_name["blk.0.ffn_down.weight"].dtype == "Q4_K"
    assert by_name["blk.0.attn_k.weight"].extra["raw_shape"] == (2, 128)


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_custom_alignment(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / "a.gguf"
    write_sample(path, alignment=alignment, seed=alignment)
    data = path.read_bytes()
    header = parse_gguf(data, file=str(path), file_size=len(data))
    assert header.alignment == alignment == header.metadata["general.alignment"]
    assert header.data_start % alignment == 0
    assert all(t.offset % alignment == 0 for t in header.tensors)
    cross_check(path, header)


def test_v2_has_the_same_layout(tmp_path: Path) -> None:
    path = tmp_path / "v3.gguf"
    write_sample(path)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(data)
    header = parse_gguf(bytes(data), file=str(v2), file_size=len(data))
    assert header.version == 2
    cross_check(v2, header)


def test_accepts_any_buffer_without_copying(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_sample(path)
    expected = parse(path.read_bytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mv = memoryview(mm)
        try:
            got = parse_gguf(mv, file="m.gguf", file_size=len(mm))
        finally:
            mv.release()  # the mmap closes only when no view is left
    assert got == expected and got.metadata == expected.metadata
    arr = np.fromfile(path, dtype=np.uint8)
    assert parse_gguf(arr, file="m.gguf", file_size=arr.size) == expected
    assert parse_gguf(bytearray(arr), file="m.gguf", file_size=arr.size) == expected
    assert parse_gguf(arr.view("<u4"), file="m.gguf", file_size=arr.size) == expected  # items wider than bytes
    # A prefix holding just the header is enough; the file size still bounds the tensors.
    assert parse_gguf(arr[: expected.data_start], file="m.gguf", file_size=arr.size) == expected


# ---- golden bytes ----

GOLDEN = (
    b"GGUF"
    + b"\x03\x00\x00\x00"  # magic, version 3
    + b"\x01\x00\x00\x00\x00\x00\x00\x00"  # one tensor
    + b"\x02\x00\x00\x00\x00\x00\x00\x00"  # two key/values
    + b"\x14\x00\x00\x00\x00\x00\x00\x00general.architecture"
    + b"\x08\x00\x00\x00"
    + b"\x01\x00\x00\x00\x00\x00\x00\x00x"  # STRING "x"
    + b"\x01\x00\x00\x00\x00\x00\x00\x00n"
    + b"\x04\x00\x00\x00"
    + b"\x07\x00\x00\x00"  # UINT32 7
    + b"\x01\x00\x00\x00\x00\x00\x00\x00t"
    + b"\x02\x00\x00\x00"  # tensor "t", 2 dims
    + b"\x03\x00\x00\x00\x00\x00\x00\x00"
    + b"\x02\x00\x00\x00\x00\x00\x00\x00"  # ne = (3, 2)
    + b"\x00\x00\x00\x00"
    + b"\x00\x00\x00\x00\x00\x00\x00\x00"  # F32, offset 0
    + bytes(5)  # header is 123 bytes: pad to 128
    + np.arange(6, dtype="<f4").tobytes()
    + bytes(8)  # the data, padded to 32
)


def test_golden_bytes(tmp_path: Path) -> None:
    assert GOLDEN == pack(
        [kv_str("general.architecture", "x"), kv_u32("n", 7)],
        [tensor_info("t", (3, 2), F32, 0)],
        data=np.arange(6, dtype="<f4").tobytes() + bytes(8),
    )
    w = GGUFWriter(tmp_path / "tiny.gguf", arch="x")
    w.add_uint32("n", 7)
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert (tmp_path / "tiny.gguf").read_bytes() == GOLDEN

    h = parse(GOLDEN)
    assert (h.version, h.alignment, h.data_start) == (3, 32, 128)
    assert h.metadata == {"general.architecture": "x", "n": 7}
    assert h.tensors == [TensorInfo("t", "F32", (2, 3), "m.gguf", 128, 24, ggml_type=F32, alignment=32)]
    assert h.tensors[0].extra == {"raw_shape": (2, 3)}


# ---- refusals ----


def test_bad_magic() -> None:
    refused(b"GGML" + GOLDEN[4:], "not a GGUF file")


def test_v1_refused() -> None:
    refused(GOLDEN[:4] + struct.pack("<I", 1) + GOLDEN[8:], "v1 is not supported")


def test_unknown_version() -> None:
    refused(GOLDEN[:4] + struct.pack("<I", 4) + GOLDEN[8:], "unknown GGUF version 4")


def test_big_endian_refused(tmp_path: Path) -> None:
    refused(GOLDEN[:4] + struct.pack(">I", 3) + GOLDEN[8:], "big-endian")
    path = tmp_path / "be.gguf"
    write_sample(path, endianess=GGUFEndian.BIG)
    refused(path.read_bytes(), "big-endian GGUF \\(v3\\)")


def test_every_prefix_is_refused_cleanly() -> None:
    h = parse(GOLDEN)
    for n in range(len(GOLDEN)):
        # The whole file cut short: header truncation, then a tensor running past the end.
        if n >= 152:  # the tensor's bytes are whole; only the padding after them is missing
            assert parse(GOLDEN[:n]) == h
            continue
        with pytest.raises(FormatError) as e:
            parse(GOLDEN[:n])
        assert e.value.file == "m.gguf"
        expect = "header runs past the end of the file" if n < 123 else "outside the data region"
        assert expect in str(e.value), n
        # Only a prefix in hand, the file whole: fine once the header is all there.
        if n < 123:
            with pytest.raises(FormatError, match="header runs past the end of the .*-byte buffer"):
                parse(GOLDEN[:n], file_size=len(GOLDEN))
        else:
            assert parse(GOLDEN[:n], file_size=len(GOLDEN)) == h


def test_every_prefix_of_a_real_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_sample(path)
    data = path.read_bytes()
    end = parse(data).data_start
    for n in range(0, end, 3):  # every third length keeps this quick; the tiny file takes all of them
        with pytest.raises(FormatError):
            parse(data[:n])


def test_random_corruption_never_escapes_as_another_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    path = tmp_path / "m.gguf"
    write_sample(path)
    data = path.read_bytes()
    end = parse(data).data_start
    outcomes = set()
    for _ in range(400):
        bad = bytearray(data[:end])
        for i in rng.integers(0, end, int(rng.integers(1, 4))):
            bad[i] = int(rng.integers(0, 256))
        try:
            parse(bytes(bad), file_size=len(data))
            outcomes.add("ok")
        except FormatError:
            outcomes.add("refused")
    assert "refused" in outcomes


def test_tensor_out_of_file() -> None:
    data = header_with(tensors=(tensor_info("w", (8,), F32, 0),), data=bytes(16))
    refused(data, "outside the data region", tensor="w")
    refused(GOLDEN, "outside the data region", tensor="t", file_size=len(GOLDEN) - 9)


def test_overlapping_tensors() -> None:
    tensors = (tensor_info("a", (16,), F32, 0), tensor_info("b", (8,), F32, 32))
    refused(header_with(tensors=tensors, data=bytes(128)), "overlap those of tensor 'a'", tensor="b")


def test_misaligned_offset() -> None:
    at16 = (tensor_info("w", (4,), F32, 16),)
    refused(header_with(tensors=at16, data=bytes(64)), "offset 16 is not a multiple of the alignment 32", tensor="w")
    kv = kv_u32("general.alignment", 8)
    assert parse(header_with(kv, tensors=at16, data=bytes(64), alignment=8)).tensors[0].offset % 8 == 0


@pytest.mark.parametrize("ggml_type", [4, 5, 31, 99, 2**32 - 1])
def test_unknown_ggml_type(ggml_type: int) -> None:
    refused(
        header_with(tensors=(tensor_info("w", (32,), ggml_type, 0),), data=bytes(256)),
        f"unknown ggml type {ggml_type}",
        tensor="w",
    )


def test_row_not_whole_blocks() -> None:
    refused(
        header_with(tensors=(tensor_info("w", (16, 2), int(Q.Q8_0), 0),), data=bytes(64)),
        "row length 16 is not a multiple of the Q8_0 block size 32",
        tensor="w",
    )
    refused(
        header_with(tensors=(tensor_info("w", (), int(Q.Q4_K), 0),), data=bytes(256)),
        "row length 1 is not a multiple",
        tensor="w",
    )


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**32 - 1])
def test_bad_alignment(alignment: int) -> None:
    refused(header_with(kv_u32("general.alignment", alignment)), f"alignment {alignment} is not a power of two")


def test_alignment_must_be_uint32() -> None:
    refused(header_with(s("general.alignment") + struct.pack("<IQ", V.UINT64, 32)), "not uint32")
    refused(header_with(kv_str("general.alignment", "32")), "not uint32")


def test_too_many_dims() -> None:
    ne = (1,) * (MAX_DIMS + 1)
    refused(
        header_with(tensors=(tensor_info("w", ne, F32, 0),), data=bytes(32)),
        "5 dimensions exceed the limit of 4",
        tensor="w",
    )
    four = parse(header_with(tensors=(tensor_info("w", (1, 2, 3, 4), F32, 0),), data=bytes(96)))
    assert four.tensors[0].shape == (4, 3, 2, 1)


def test_scalar_and_empty_tensors() -> None:
    h = parse(header_with(tensors=(tensor_info("s", (), F32, 0), tensor_info("e", (0, 5), F32, 32)), data=bytes(32)))
    assert [(t.shape, t.length) for t in h.tensors] == [((), 4), ((5, 0), 0)]


def test_element_count_overflow() -> None:
    refused(header_with(tensors=(tensor_info("w", (2**32, 2**32), F32, 0),)), "more than 2\\*\\*63", tensor="w")


def test_unknown_value_type() -> None:
    refused(header_with(s("k") + struct.pack("<I", 13) + bytes(8)), "unknown value type 13")
    refused(header_with(s("k") + struct.pack("<IIQ", V.ARRAY, 13, 1) + bytes(8)), "unknown value type 13")


def test_counts_against_limits() -> None:
    base = header_with()
    for pos, n, what in (
        (8, MAX_TENSORS + 1, "tensor count .* exceeds the limit"),
        (16, MAX_KV + 1, "metadata count .* exceeds the limit"),
        (16, 2**64 - 1, "metadata count .* exceeds the limit"),
        (8, 10**6, "header runs past the end .* 1000000 tensor records"),
    ):
        refused(base[:pos] + struct.pack("<Q", n) + base[pos + 8 :], what)


def test_string_and_array_lengths_against_limits_and_buffer() -> None:
    def kv(raw: bytes) -> bytes:
        return header_with(s("k") + raw, alignment=1)  # no padding after the header to read into

    refused(header_with(struct.pack("<Q", MAX_STRING + 1)), "length .* exceeds the limit")
    refused(kv(struct.pack("<IQ", V.STRING, 2**63)), "length .* exceeds the limit")
    refused(kv(struct.pack("<IQ", V.STRING, 1000) + b"abc"), "header runs past the end")
    refused(kv(struct.pack("<IIQ", V.ARRAY, V.UINT8, MAX_ARRAY + 1)), "exceeds the limit")
    refused(kv(struct.pack("<IIQ", V.ARRAY, V.UINT64, 100) + bytes(400)), "header runs past the end")
    refused(kv(struct.pack("<IIQ", V.ARRAY, V.STRING, 10) + s("a") * 9), "header runs past the end")
    refused(kv(struct.pack("<IIQ", V.ARRAY, V.STRING, 2**20)), "header runs past the end .* 1048576 items")
    assert parse(kv(struct.pack("<IIQ", V.ARRAY, V.STRING, 10) + s("a") * 10)).metadata["k"] == ["a"] * 10


def test_nesting_limit() -> None:
    # MAX_NESTING levels of arrays: the outer value, then arrays of arrays, then [5].
    deep = struct.pack("<IQ", V.ARRAY, 1) * (MAX_NESTING - 1) + struct.pack("<IQI", V.UINT32, 1, 5)
    v = parse(header_with(s("k") + struct.pack("<I", V.ARRAY) + deep)).metadata["k"]
    for _ in range(MAX_NESTING - 1):
        v = v[0]
    assert v == [5]
    deeper = struct.pack("<IQ", V.ARRAY, 1) + deep
    refused(header_with(s("k") + struct.pack("<I", V.ARRAY) + deeper), "nests arrays deeper")


def test_duplicates() -> None:
    refused(header_with(kv_u32("n", 1), kv_u32("n", 2)), "key 'n' appears twice")
    tensors = (tensor_info("w", (8,), F32, 0), tensor_info("w", (8,), F32, 32))
    refused(header_with(tensors=tensors, data=bytes(64)), "appears twice", tensor="w")


def test_names_must_be_utf8_values_need_not_be() -> None:
    refused(header_with(s(b"\xff\xfe") + struct.pack("<II", V.UINT32, 1)), "not valid UTF-8")
    refused(header_with(tensors=(s(b"\xc3") + struct.pack("<IQIQ", 1, 8, F32, 0),), data=bytes(32)), "not valid UTF-8")
    h = parse(header_with(s("k") + struct.pack("<I", V.STRING) + s(b"a\xffb")))
    assert h.metadata["k"].encode("utf-8", "surrogateescape") == b"a\xffb"


def test_string_arrays_across_windows() -> None:
    # More than a MiB of strings, one of them larger than the window the decoder copies at a time.
    texts = [f"tök{i}" for i in range(60_000)] + ["x" * (1 << 21)] + ["é" * 3000] * 300 + [""]
    kv = s("t") + struct.pack("<IIQ", V.ARRAY, V.STRING, len(texts)) + b"".join(s(t) for t in texts)
    assert parse(header_with(kv, alignment=1)).metadata["t"] == texts
    head = s("t") + struct.pack("<IIQ", V.ARRAY, V.STRING, 3) + s("a")
    # Enough bytes follow for three strings by count; each fails in a different place.
    refused(header_with(head + struct.pack("<Q", MAX_STRING + 1) + bytes(16), alignment=1), "exceeds the limit")
    refused(header_with(head + struct.pack("<Q", 1000) + bytes(16), alignment=1), "header runs past the end")
    refused(header_with(head + s("bbbbbbb") + b"\x01\x00", alignment=1), "header runs past the end")


def test_large_numeric_array_is_decoded() -> None:
    scores = np.linspace(-1, 1, 200_000, dtype="<f4")
    kv = s("tokenizer.ggml.scores") + struct.pack("<IIQ", V.ARRAY, V.FLOAT32, scores.size) + scores.tobytes()
    h = parse(header_with(kv))
    assert h.metadata["tokenizer.ggml.scores"] == scores.tolist()


# ---- dequantize ----


def test_dequantize_matches_gguf(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_sample(path)
    data = path.read_bytes()
    reader = GGUFReader(path)
    for t, rt in zip(parse(data).tensors, reader.tensors, strict=False):
        dtype, shape = numpy_dtype_and_shape(t)
        raw = np.frombuffer(data, dtype=dtype, count=t.length // dtype.itemsize, offset=t.offset).reshape(shape)
        got = dequantize(raw, t.ggml_type)
        assert got.dtype == np.float32 and got.shape == t.shape, t.name
        if rt.tensor_type in (Q.F16, Q.F32, Q.BF16) or t.quantized:
            np.testing.assert_array_equal(got, ref_dequantize(rt.data, rt.tensor_type))
        else:
            np.testing.assert_array_equal(got, rt.data.astype(np.float32))
        # Raw bytes of any shape work too, as long as rows are whole.
        np.testing.assert_array_equal(dequantize(raw.view(np.uint8), t.ggml_type), got)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.BF16, Q.F16])
def test_dequantize_inverts_quantize(qtype: Q) -> None:
    src = np.random.default_rng(2).standard_normal((3, 64), dtype=np.float32)
    got = dequantize(quantize(src, qtype).view(np.uint8), int(qtype))
    assert got.shape == src.shape and got.dtype == np.float32
    tolerance = {Q.Q8_0: 0.03, Q.Q4_0: 0.5, Q.BF16: 0.02, Q.F16: 0.002}[qtype]
    np.testing.assert_allclose(got, src, atol=tolerance)


def test_dequantize_refusals() -> None:
    with pytest.raises(OptionError, match="unknown ggml type"):
        dequantize(np.zeros(34, np.uint8), 99)
    with pytest.raises(OptionError, match="not whole Q8_0 rows"):
        dequantize(np.zeros(33, np.uint8), int(Q.Q8_0))
    _block, size = GGML_QUANT_SIZES[Q.Q8_1]
    with pytest.raises(OptionError, match="cannot dequantize Q8_1"):
        dequantize(np.zeros(size, np.uint8), int(Q.Q8_1))


def test_numpy_view_needs_a_gguf_tensor() -> None:
    with pytest.raises(OptionError):
        numpy_dtype_and_shape(TensorInfo("x", "F32", (1,), "f", 0, 4))


def test_buffer_must_be_contiguous_bytes() -> None:
    with pytest.raises(OptionError):
        parse_gguf("GGUF", file="m.gguf", file_size=4)  # type: ignore[arg-type]
    with pytest.raises(OptionError):
        parse_gguf(np.frombuffer(GOLDEN, np.uint8)[::2], file="m.gguf", file_size=80)


# ---- opening and loading GGUF files ----


@pytest.mark.parametrize("name", ["m.gguf", "M.GGUF"])
def test_a_gguf_file_with_a_bad_magic_says_so(tmp_path: Path, name: str) -> None:
    import weightlift as wl

    path = tmp_path / name
    path.write_bytes(b"GGML" + GOLDEN[4:])
    with pytest.raises(FormatError, match="not a GGUF file \\(magic b'GGML'"):
        wl.open(path)
    path.write_bytes(b"")
    with pytest.raises(FormatError, match="header runs past the end of the file reading the magic"):
        wl.open(path)


def test_empty_tensors_with_huge_dimensions_are_refused(tmp_path: Path) -> None:
    for ne in ((2**62, 0), (0, 2**62), (2**31, 0, 2**31), (0, 2**64 - 1)):
        data = header_with(tensors=(tensor_info("e", ne, F32, 0),))
        refused(data, "shape .* is too large", tensor="e")
        path = tmp_path / "e.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError):  # gguf-py's reader fails on them, outside any error of its own
            GGUFReader(path).tensors[0].data  # noqa: B018


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_empty_tensors_at_the_extent_limit_load(tmp_path: Path, framework: str) -> None:
    import weightlift as wl
    from weightlift.formats import MAX_EXTENT

    if framework == "torch":
        pytest.importorskip("torch")
    q8 = MAX_EXTENT // 32 * 32
    tensors = (
        tensor_info("f", (MAX_EXTENT, 0), F32, 0),
        tensor_info("i", (0, MAX_EXTENT), int(Q.I64), 0),
        tensor_info("q", (q8, 0), int(Q.Q8_0), 0),
        tensor_info("b", (0, 2, MAX_EXTENT // 2), int(Q.BF16), 0),
    )
    path = tmp_path / "edge.gguf"
    path.write_bytes(header_with(tensors=tensors))
    want = {"f": (0, MAX_EXTENT), "i": (MAX_EXTENT, 0), "q": (0, q8), "b": (MAX_EXTENT // 2, 2, 0)}
    for kw in ({}, {"copy": False}, {"dequantize": True}, {"dtype": "F64"}):
        out = wl.load(path, framework=framework, **kw)
        got = {n: tuple(v.shape) for n, v in out.items()}
        if not kw.get("dequantize"):
            got["q"] = want["q"]  # raw blocks: (0, q8 // 32 * 34)
            assert tuple(out["q"].shape) == (0, q8 // 32 * 34)
        assert got == want, kw


def test_what_a_load_returns(tmp_path: Path) -> None:
    import ml_dtypes

    import weightlift as wl
    from weightlift.cli import build_parser

    path = tmp_path / "m.gguf"
    write_sample(path)
    kinds = {
        "blk.0.attn_q.weight": "F16",
        "blk.0.attn_k.weight": "BF16",
        "blk.0.attn_v.weight": "Q8_0",
        "output_norm.weight": "F32",
        "i32": "I32",
    }
    plain = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "I32": np.int32}
    as_stored = wl.load(path, select=set(kinds))
    assert {n: v.dtype for n, v in as_stored.items()} == {n: np.dtype(plain.get(k, np.uint8)) for n, k in kinds.items()}
    # dequantize decodes quantized blocks only: F16 and BF16 are not quantized, as in ggml
    decoded = wl.load(path, select=set(kinds), dequantize=True)
    assert {n: v.dtype for n, v in decoded.items()} == {n: np.dtype(plain.get(k, np.float32)) for n, k in kinds.items()}
    everything = wl.load(path, select=set(kinds), dequantize=True, dtype="F32")
    assert {n: v.dtype for n, v in everything.items()} == {
        n: np.dtype(np.int32 if k == "I32" else np.float32) for n, k in kinds.items()
    }
    load_cmd = next(a for a in build_parser()._actions if a.dest == "command").choices["load"]
    (help_text,) = [a.help for a in load_cmd._actions if a.dest == "dequantize"]
    assert "quantized tensors to float32" in help_text and "F16 and BF16 keep their type" in help_text


# ---- where gguf.GGUFReader is followed, and where it is not ----


def test_empty_tensor_past_the_end_of_the_file_is_taken_as_gguf_takes_it(tmp_path: Path) -> None:
    import weightlift as wl

    far = 1 << 40
    data = header_with(tensors=(tensor_info("w", (4,), F32, 0), tensor_info("e", (0, 5), F32, far)), data=bytes(16))
    path = tmp_path / "e.gguf"
    path.write_bytes(data)
    reader = GGUFReader(path)
    assert [(t.name, t.data.shape) for t in reader.tensors] == [("w", (4,)), ("e", (5, 0))]
    header = parse(data, file=str(path))
    assert header.data_start == reader.data_offset
    assert [(t.offset, t.shape) for t in header.tensors] == [(t.data_offset, t.data.shape) for t in reader.tensors]
    assert header.tensors[1].offset == reader.tensors[1].data_offset and header.tensors[1].length == 0
    for kw in ({}, {"copy": False}, {"verify": True}, {"dequantize": True}):
        out = wl.load(path, **kw)
        assert {n: v.shape for n, v in out.items()} == {"w": (4,), "e": (5, 0)}, kw
    # a tensor that holds bytes still has to lie in the file
    refused(header_with(tensors=(tensor_info("w", (4,), F32, far),), data=bytes(16)), "outside", tensor="w")


def test_folder_with_two_gguf_files_names_both(tmp_path: Path) -> None:
    import weightlift as wl

    write_sample(tmp_path / "a.gguf")
    assert wl.open(tmp_path).files == [str(tmp_path / "a.gguf")]
    write_sample(tmp_path / "b.gguf")
    with pytest.raises(FormatError, match="several .gguf files \\(a.gguf, b.gguf\\); name one"):
        wl.open(tmp_path)


def test_dequantize_error_names_file_and_tensor(tmp_path: Path) -> None:
    import weightlift as wl

    block, size = GGML_QUANT_SIZES[Q.Q8_1]
    path = tmp_path / "q.gguf"
    path.write_bytes(header_with(tensors=(tensor_info("blk.0.q", (block,), int(Q.Q8_1), 0),), data=bytes(size)))
    assert wl.load(path)["blk.0.q"].shape == (size,)  # raw blocks load
    with pytest.raises(OptionError, match="cannot dequantize Q8_1") as e:
        wl.load(path, dequantize=True)
    assert str(path) in str(e.value) and "'blk.0.q'" in str(e.value)
    with pytest.raises(OptionError, match="^f.gguf: tensor 't': the gguf package cannot dequantize Q8_1"):
        dequantize(np.zeros(size, np.uint8), int(Q.Q8_1), file="f.gguf", tensor="t")


def _reader_accepts(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(data)
    GGUFReader(path)


def test_each_deliberate_refusal_is_one_the_reader_accepts(tmp_path: Path) -> None:
    """The numbered list in the module's docstring, case by case (limits stand for item 4)."""
    be = tmp_path / "be.gguf"
    write_sample(be, endianess=GGUFEndian.BIG)
    whole = pack([kv_str("general.architecture", "xyz")], [], alignment=1)
    cases = {
        "big-endian": be.read_bytes(),
        "runs past the end": whole[:-2],
        "5 dimensions exceed": header_with(tensors=(tensor_info("w", (1, 1, 1, 1, 2), F32, 0),), data=bytes(32)),
        "not a multiple of the alignment": header_with(tensors=(tensor_info("w", (4,), F32, 16),), data=bytes(64)),
        "overlap": header_with(
            tensors=(tensor_info("a", (16,), F32, 0), tensor_info("b", (8,), F32, 32)), data=bytes(128)
        ),
    }
    for match, data in cases.items():
        _reader_accepts(tmp_path, data)
        with pytest.raises(FormatError, match=match):
            parse(data)
    with pytest.raises(FormatError, match="nests arrays deeper"):
        nested = s("k") + struct.pack("<I", V.ARRAY)
        for _ in range(MAX_NESTING + 1):
            nested += struct.pack("<IQ", V.ARRAY, 1)
        parse(pack([nested + struct.pack("<IQ", V.UINT8, 0)], []))


# ---- split models: the keys and the names ----


def test_split_keys() -> None:
    keys = {"split.no": 1, "split.count": 3, "split.tensors.count": 40}
    assert split_of(keys, file="m.gguf") == Split(1, 3, 40)
    assert split_of({}, file="m.gguf") is None
    assert split_of({"split.count": 1}, file="m.gguf") is None  # one file: llama.cpp ignores the rest
    for bad, match in [
        ({**keys, "split.count": 0}, "split.count is 0, not an integer from 1 to 65535"),
        ({**keys, "split.count": True}, "split.count is True"),
        ({**keys, "split.no": 3}, "split.no is 3, not an integer from 0 to 2"),
        ({"split.count": 3, "split.tensors.count": 40}, "split.no is missing"),
        ({**keys, "split.tensors.count": -1}, "split.tensors.count is -1"),
        ({**keys, "split.tensors.count": "40"}, "split.tensors.count is '40'"),
    ]:
        with pytest.raises(FormatError, match=match) as e:
            split_of(bad, file="m.gguf")
        assert e.value.file == "m.gguf"


def test_split_names_follow_llama_cpp() -> None:
    assert split_name("dir-x/model", 0, 4) == "dir-x/model-00001-of-00004.gguf"
    assert split_parts("model-Q4-00002-of-00004.gguf") == ("model-Q4", 1, 4)
    for other in (
        "model.gguf",
        "-00001-of-00004.gguf",
        "m-00000-of-00004.gguf",
        "m-1-of-4.gguf",
        "m-00001-of-00004.GGUF",
    ):
        assert split_parts(other) is None, other


# ---- a prefix that ends inside the header, and a header that is broken ----


def test_a_short_prefix_says_how_much_more_it_needs(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_sample(path)
    data = path.read_bytes()
    n, steps = 16, 0
    while True:  # each Truncated names a longer prefix that gets further; the last parses
        try:
            header = parse_gguf(data[:n], file="m.gguf", file_size=len(data))
            break
        except Truncated as e:
            assert isinstance(e, FormatError) and e.file == "m.gguf"
            assert n < e.needed <= len(data)
            n, steps = e.needed, steps + 1
    assert steps > 3 and header.tensors == parse(data).tensors


def test_a_broken_header_is_not_truncated_whatever_the_prefix() -> None:
    broken = header_with(s("k") + struct.pack("<I", 99) + bytes(64), alignment=1)  # an unknown value type
    for cut in (len(broken), broken.index(s("k") + struct.pack("<I", 99)) + 13):  # ends at the type
        with pytest.raises(FormatError, match="unknown value type 99") as e:
            parse_gguf(broken[:cut], file="m.gguf", file_size=1 << 30)
        assert not isinstance(e.value, Truncated)
    # a count past the end of the file is the file's fault, however short the prefix
    huge = header_with(s("k") + struct.pack("<IQ", V.STRING, 1 << 27), alignment=1)
    with pytest.raises(FormatError, match="past the end of the file") as e:
        parse_gguf(huge, file="m.gguf", file_size=1 << 20)
    assert not isinstance(e.value, Truncated)
    with pytest.raises(Truncated) as t:
        parse_gguf(huge, file="m.gguf", file_size=1 << 30)
    assert t.value.needed == len(huge) + (1 << 27)
