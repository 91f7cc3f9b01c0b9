#!/usr/bin/env python3
"""Fuzz the safetensors and GGUF header parsers under atheris (libFuzzer), for long runs.

The property is the one tests/formats/test_format_fuzz.py checks for a few seconds: any bytes either
parse into tensors that lie inside the file with shapes numpy can hold, or raise FormatError;
and a safetensors input the reference parser (``safetensors.deserialize``) refuses, we refuse,
while one we accept, it accepts with the same tensors. We may refuse more only for the
deliberate reasons the parser's docstring gives. Any other outcome is a crash, and libFuzzer
writes the input behind it (``crash-<sha1>``) to the working directory.

    pip install atheris
    mkdir -p /tmp/fuzz-corpus   # libFuzzer adds new inputs to the first folder only
    python bench/fuzz_formats.py /tmp/fuzz-corpus tests/formats/corpus/formats -max_total_time=3600
    python bench/fuzz_formats.py crash-1234abcd   # replay one input

Options other than ``--no-reference`` go to libFuzzer (``-help=1`` lists them).
"""

from __future__ import annotations

import math
import sys

import atheris
import numpy as np

with atheris.instrument_imports():
    from weightlift.dtypes import byte_length
    from weightlift.errors import FormatError
    from weightlift.formats import MAX_EXTENT
    from weightlift.formats.gguf import numpy_dtype_and_shape, parse_gguf
    from weightlift.formats.safetensors import PREFIX_SIZE, header_length, parse_header

DELIBERATE = ("appears twice", "non-zero dimensions multiply", "dimensions, more than numpy's")
REFERENCE = True


def parse(data: bytes) -> list:
    if data[:4] == b"GGUF":
        return parse_gguf(data, file="fuzz", file_size=len(data)).tensors
    n = header_length(data[:PREFIX_SIZE], file="fuzz", file_size=len(data))
    return parse_header(data[PREFIX_SIZE : PREFIX_SIZE + n], file="fuzz", file_size=len(data))[0]


def check_accepted(data: bytes, tensors: list) -> None:
    assert len({t.name for t in tensors}) == len(tensors), "a name twice"
    for t in tensors:
        t.name.encode("utf-8")
        assert 0 < t.offset <= t.end <= len(data), t
        assert math.prod(d for d in t.shape if d) <= MAX_EXTENT, t
        np.empty(t.shape, np.float64)
        if data[:4] == b"GGUF":
            dtype, shape = numpy_dtype_and_shape(t)
            raw = np.frombuffer(data, np.uint8, count=t.length, offset=t.offset) if t.length else np.empty(0, np.uint8)
            assert raw.view(dtype).reshape(shape).nbytes == t.length
        else:
            assert t.length == byte_length(t.dtype, t.shape), t


def reference(data: bytes):
    import safetensors

    try:
        out = safetensors.deserialize(data)
    except safetensors.SafetensorError:
        return None
    return {name: (v["dtype"], tuple(v["shape"]), bytes(v["data"])) for name, v in out}


def test_one_input(data: bytes) -> None:
    try:
        tensors = parse(data)
    except FormatError as e:
        tensors, refusal = None, e
    else:
        check_accepted(data, tensors)
    if not REFERENCE or data[:4] == b"GGUF":
        return
    try:
        ref = reference(data)
    except BaseException:  # noqa: BLE001 - a panic in the reference is not ours to report
        return
    if tensors is None:
        assert ref is None or any(why in refusal.reason for why in DELIBERATE), (refusal, ref)
    else:
        assert ref == {t.name: (t.dtype, t.shape, data[t.offset : t.end]) for t in tensors}, (tensors, ref)


def main() -> None:
    global REFERENCE
    argv = [a for a in sys.argv if a != "--no-reference"]
    REFERENCE = len(argv) == len(sys.argv)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
