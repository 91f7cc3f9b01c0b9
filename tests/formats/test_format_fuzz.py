"""Both header parsers under arbitrary bytes: a valid list of tensors or a FormatError, nothing else.

The seeds are the crafted headers in tests/formats/corpus/formats (see make_corpus.py there), each
checked first against the outcome its name promises. Hypothesis then mutates them, and builds
safetensors headers from parts, a few hundred examples each, derandomized so that a run is
repeatable. Every safetensors input is also handed to the reference parser
(``safetensors.deserialize``): whatever it refuses we refuse, whatever we accept it accepts
with the same tensors, and where it accepts what we refuse, the reason is one of the
deliberate ones the parser's docstring gives. ``bench/fuzz_formats.py`` runs the same checks
for hours under atheris.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from weightlift.dtypes import DTYPES, byte_length  # noqa: E402
from weightlift.errors import FormatError  # noqa: E402
from weightlift.formats import MAX_EXTENT, TensorInfo  # noqa: E402
from weightlift.formats.gguf import numpy_dtype_and_shape, parse_gguf  # noqa: E402
from weightlift.formats.safetensors import PREFIX_SIZE, header_length, parse_header  # noqa: E402
from weightlift.memory.targets import view_as  # noqa: E402

CORPUS = Path(__file__).parent / "corpus" / "formats"
SEEDS = sorted(p for p in CORPUS.iterdir() if p.suffix in (".safetensors", ".gguf"))
# Why we may refuse what the reference accepts: the deliberate refusals, by their messages.
DELIBERATE = ("appears twice", "non-zero dimensions multiply", "dimensions, more than numpy's")

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def parse(data: bytes) -> list[TensorInfo]:
    """The tensors of ``data`` as weightlift reads a file holding it; FormatError if it is bad."""
    if data[:4] == b"GGUF":
        return parse_gguf(data, file="fuzz", file_size=len(data)).tensors
    n = header_length(data[:PREFIX_SIZE], file="fuzz", file_size=len(data))
    return parse_header(data[PREFIX_SIZE : PREFIX_SIZE + n], file="fuzz", file_size=len(data))[0]


def check_accepted(data: bytes, tensors: list[TensorInfo]) -> None:
    """What an accepted header promises a loader."""
    assert len({t.name for t in tensors}) == len(tensors)
    gguf = data[:4] == b"GGUF"
    for t in tensors:
        t.name.encode("utf-8")  # printable and storable: no lone surrogate
        assert 0 < t.offset <= t.end <= len(data), t
        assert math.prod(d for d in t.shape if d) <= MAX_EXTENT
        np.empty(t.shape, np.float64)  # even an empty tensor has a shape numpy can hold
        raw = np.frombuffer(data, np.uint8, count=t.length, offset=t.offset) if t.length else np.empty(0, np.uint8)
        if gguf:
            dtype, shape = numpy_dtype_and_shape(t)
            assert raw.view(dtype).reshape(shape).nbytes == t.length
        else:
            assert t.length == byte_length(t.dtype, t.shape)
            view_as(raw, t.dtype, t.shape, "numpy")
    if not gguf and tensors:  # safetensors tiles its data region exactly
        ordered = sorted(tensors, key=lambda t: (t.offset, t.end))
        assert ordered[-1].end == len(data)
        assert all(a.end == b.offset for a, b in zip(ordered, ordered[1:], strict=False))


class _NoVerdict(Exception):
    """The reference parser failed other than by refusing (a panic): nothing to compare."""


def reference(data: bytes) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    """What the reference parser makes of a safetensors file: tensors, or None if it refuses."""
    safetensors = pytest.importorskip("safetensors")
    try:
        out = safetensors.deserialize(data)
    except safetensors.SafetensorError:
        return None
    except BaseException as e:  # noqa: BLE001 - pyo3 panics derive from BaseException
        raise _NoVerdict(repr(e)) from None
    return {name: (v["dtype"], tuple(v["shape"]), bytes(v["data"])) for name, v in out}


def outcome(data: bytes) -> list[TensorInfo] | FormatError:
    try:
        tensors = parse(data)
    except FormatError as e:
        return e
    check_accepted(data, tensors)
    return tensors


def check(data: bytes) -> None:
    """The property: FormatError or a sound list of tensors, and no disagreement with the reference."""
    got = outcome(data)
    if data[:4] == b"GGUF":
        return
    try:
        ref = reference(data)
    except _NoVerdict:
        return
    if isinstance(got, FormatError):
        assert ref is None or any(why in got.reason for why in DELIBERATE), (got, ref)
    else:
        assert ref is not None, got
        assert ref == {t.name: (t.dtype, t.shape, data[t.offset : t.end]) for t in got}


# ---- the seeds ----


@pytest.mark.parametrize("path", SEEDS, ids=[p.name for p in SEEDS])
def test_seed_has_the_promised_outcome(path: Path) -> None:
    data = path.read_bytes()
    kind = path.name.split("-")[0]
    got = outcome(data)
    if kind == "ok":
        assert not isinstance(got, FormatError), got
    else:
        assert isinstance(got, FormatError), path.name
        assert got.file == "fuzz"
    if path.suffix == ".safetensors":
        ref = reference(data)
        assert (ref is not None) == (kind in ("ok", "dev")), path.name
        if kind == "dev":
            assert any(why in got.reason for why in DELIBERATE), got  # type: ignore[union-attr]
    check(data)


def test_corpus_is_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_corpus", CORPUS / "make_corpus.py")
    make = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(make)  # type: ignore[union-attr]
    want = {f"{n}.safetensors": d for n, d in make.safetensors_files().items()}
    want.update({f"{n}.gguf": d for n, d in make.gguf_files().items()})
    assert {p.name for p in SEEDS} == set(want)
    for p in SEEDS:
        if p.name != "ok-sample.gguf":  # GGUFWriter's output may change between gguf releases
            assert p.read_bytes() == want[p.name], p.name


# ---- mutations of the seeds ----

_SEED_BYTES = [p.read_bytes() for p in SEEDS]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(_SEED_BYTES)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice", "length"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[i] = draw(st.sampled_from([0, 1, 0x22, 0x2D, 0x30, 0x5B, 0x5C, 0x7B, 0x7F, 0x80, 0xFF]))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[i:]
        elif op == "splice":
            other = draw(st.sampled_from(_SEED_BYTES))
            j = draw(st.integers(0, len(other)))
            data[i:] = other[j:]
        elif op == "length" and data[:4] != b"GGUF":
            # keep a safetensors header length in step with an edit, so the JSON gets parsed
            data[:8] = struct.pack("<Q", max(0, len(data) - 8 - draw(st.integers(0, 16))))
    return bytes(data)


@FUZZ
@given(mutated())
def test_mutated_seeds(data: bytes) -> None:
    check(data)


# ---- safetensors headers built from parts ----

_NAMES = st.one_of(st.text(max_size=6), st.sampled_from(["a", "b", "__metadata__", "\ud800", "é", "a\x00"]))
_DIM = st.one_of(st.integers(0, 4), st.sampled_from([2**31, 2**60 - 1, 2**60, 2**62, 2**64 - 1, 2**64]))
_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=4)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def built(draw: st.DrawFn) -> bytes:
    pairs: list[tuple[str, object]] = []
    pos = 0
    for _ in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from([d.name for d in DTYPES] + ["F99", "f32"]))
        shape = draw(st.lists(_DIM, max_size=3))
        try:
            n = byte_length(dtype, tuple(shape)) if math.prod(shape) < 2**20 else 0
        except FormatError:
            n = 0
        begin = pos + draw(st.sampled_from([0, 0, 0, 1, -1]))
        end = begin + n + draw(st.sampled_from([0, 0, 0, 1, -1]))
        pos = max(pos, end)
        fields: list[tuple[str, object]] = [("dtype", dtype), ("shape", shape), ("data_offsets", [begin, end])]
        if draw(st.booleans()):
            fields.append((draw(st.text(max_size=3)), draw(_VALUES)))
        if draw(st.integers(0, 9)) == 0:
            fields.append(draw(st.sampled_from(fields)))  # a field twice
        pairs.append((draw(_NAMES), fields))
    if draw(st.booleans()):
        meta = draw(st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), _VALUES), max_size=3))
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", meta))
    if pairs and draw(st.integers(0, 9)) == 0:
        pairs.append(draw(st.sampled_from(pairs)))  # a key twice
    header = "{" + ",".join(f"{json.dumps(k)}:{_object_text(v)}" for k, v in pairs) + "}"
    data = bytes(max(0, pos + draw(st.sampled_from([0, 0, 0, 1, -1]))))
    return (
        struct.pack("<Q", len(header.encode("utf-8", "surrogatepass"))) + header.encode("utf-8", "surrogatepass") + data
    )


def _object_text(v: object) -> str:
    if isinstance(v, list) and all(isinstance(p, tuple) for p in v):  # fields, in order, repeats kept
        return "{" + ",".join(f"{json.dumps(k)}:{json.dumps(x)}" for k, x in v) + "}"  # type: ignore[misc]
    return json.dumps(v)


@settings(FUZZ, max_examples=150)  # building is slower than mutating
@given(built())
def test_built_headers(data: bytes) -> None:
    check(data)
