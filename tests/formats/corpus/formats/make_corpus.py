#!/usr/bin/env python3
"""Write the seed corpus of crafted headers next to this script; run it to regenerate them.

Each file is named ``<outcome>-<what>.<format>``. The outcome says what weightlift must do with
it and, for safetensors, what the reference parser (``safetensors.deserialize``) does:

    ok   both accept it
    bad  both refuse it
    dev  the reference accepts it and weightlift refuses it on purpose (see the parser's docstring)

GGUF files only have ``ok`` and ``bad``. tests/formats/test_format_fuzz.py checks every file against its
name and then mutates them as seeds; ``bench/fuzz_formats.py`` takes this folder as its corpus.

    python tests/formats/corpus/formats/make_corpus.py
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))  # the repository root: this file also runs as a script

import numpy as np  # noqa: E402
from gguf import GGUFWriter  # noqa: E402
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from tests.checkpoints import every_dtype  # noqa: E402
from tests.gguf_files import kv_str, kv_u32, pack, s, tensor_info  # noqa: E402
from weightlift.formats.safetensors import build_header  # noqa: E402

F32_1 = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


def st_raw(header: str | bytes, data: bytes = b"") -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw)) + raw + data


def st_obj(obj: dict, data: bytes = b"") -> bytes:
    return st_raw(json.dumps(obj, separators=(",", ":")), data)


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def safetensors_files() -> dict[str, bytes]:
    tensors = every_dtype(seed=3)
    header, _ = build_header([(n, d, sh, len(b)) for n, d, sh, b in tensors], {"format": "pt"})
    every = header + b"".join(b for *_, b in tensors)
    return {
        "ok-every-dtype": every,
        "ok-no-tensors": st_raw("{}"),
        "ok-null-metadata": st_raw('{"__metadata__":null,"a":' + F32_1 + "}", bytes(4)),
        "ok-empties-share-an-offset": st_obj(
            {
                "e": entry("F32", [0, 3], 4, 4),
                "f": entry("BF16", [2, 0], 4, 4),
                "a": entry("F32", [1], 0, 4),
                "b": entry("U8", [2], 4, 6),
            },
            bytes(6),
        ),
        "ok-unknown-fields": st_raw(
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"k":1,"k":[-0,1e300,"\\u00e9"]},"y":null}}',
            bytes(4),
        ),
        "ok-escaped-names": st_raw(
            '{"\\ud83d\\ude00":' + F32_1 + ',"a\\u001b[2Jb":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}}', bytes(4)
        ),
        "ok-whitespace": st_raw(' \n{ "a" :\t' + F32_1 + " }\r\n ", bytes(4)),
        "bad-bytes-after-the-last-tensor": st_raw('{"a":' + F32_1 + "}", bytes(5)),
        "bad-gap": st_obj({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
        "bad-first-tensor-not-at-0": st_obj({"a": entry("F32", [1], 4, 8)}, bytes(8)),
        "bad-overlap": st_obj({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, bytes(8)),
        "bad-length": st_obj({"a": entry("F32", [2], 0, 4)}, bytes(4)),
        "bad-nan": st_raw(
            '{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":NaN}}', bytes(4)
        ),
        "bad-bom": st_raw(b"\xef\xbb\xbf{}"),
        "bad-utf16": st_raw("{}".encode("utf-16")),
        "bad-lone-surrogate": st_raw('{"\\ud800":' + F32_1 + "}", bytes(4)),
        "bad-repeated-field": st_raw('{"a":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}}', bytes(4)),
        "bad-negative-zero": st_raw('{"a":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}', bytes(4)),
        "bad-too-deep": st_raw(
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + "[" * 126 + "]" * 126 + "}}", bytes(4)
        ),
        "bad-header-length": struct.pack("<Q", 100_000_001) + b"{}",
        "dev-repeated-name": st_raw(
            '{"a":' + F32_1 + ',"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)
        ),
        "dev-repeated-metadata-key": st_raw('{"__metadata__":{"k":"v","k":"w"}}'),
        "dev-empty-but-huge": st_obj({"a": entry("F32", [0, 2**62], 0, 0)}),
        "dev-65-dimensions": st_obj({"a": entry("F32", [1] * 65, 0, 4)}, bytes(4)),
    }


def gguf_sample() -> bytes:
    import tempfile

    rng = np.random.default_rng(5)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.gguf"
        w = GGUFWriter(path, arch="llama")
        w.add_uint32("test.n", 7)
        w.add_array("tokenizer.ggml.tokens", ["<s>", "é", ""])
        w.add_array("test.nested", [[1, 2], [3]])
        w.add_tensor("f32", rng.standard_normal((2, 8), dtype=np.float32))
        w.add_tensor("f16", rng.standard_normal(8).astype(np.float16))
        w.add_tensor("bf16", quantize(rng.standard_normal((1, 32), dtype=np.float32), Q.BF16), raw_dtype=Q.BF16)
        w.add_tensor("q8_0", quantize(rng.standard_normal((2, 32), dtype=np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
        w.add_tensor("i32", np.arange(3, dtype=np.int32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def gguf_files() -> dict[str, bytes]:
    arch = kv_str("general.architecture", "x")
    f32 = int(Q.F32)
    return {
        "ok-sample": gguf_sample(),
        "ok-empty-tensors": pack(
            [arch], [tensor_info("e", (0, 5), f32, 0), tensor_info("s", (), f32, 0)], data=bytes(32)
        ),
        "ok-alignment-8": pack(
            [arch, kv_u32("general.alignment", 8)], [tensor_info("w", (2,), f32, 0)], data=bytes(8), alignment=8
        ),
        "bad-magic": pack([arch], [], magic=b"GGML"),
        "bad-empty-but-huge": pack([arch], [tensor_info("e", (2**62, 0), f32, 0)]),
        "bad-outside-the-file": pack([arch], [tensor_info("w", (16,), f32, 0)], data=bytes(32)),
        "bad-string-length": pack([s("k") + struct.pack("<IQ", 8, 2**40)], []),
    }


def main() -> None:
    for old in HERE.glob("*-*.safetensors"):
        old.unlink()
    for old in HERE.glob("*-*.gguf"):
        old.unlink()
    for name, data in safetensors_files().items():
        (HERE / f"{name}.safetensors").write_bytes(data)
    for name, data in gguf_files().items():
        (HERE / f"{name}.gguf").write_bytes(data)


if __name__ == "__main__":
    main()
