"""GGUF fixtures for tests: real files from gguf.GGUFWriter, and hand-packed headers.

``write_sample`` writes a small model with plain, BF16 and quantized tensors and metadata of
every value type; it returns what it wrote so a test can compare. ``pack`` builds a header byte
by byte, independent of both the writer and our parser, for golden bytes and broken files.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGUFEndian
from gguf.constants import GGMLQuantizationType as Q
from gguf.constants import GGUFValueType as V
from gguf.quants import quantize

# key -> (value type, sub type for arrays or None, python value as our parser returns it)
SAMPLE_METADATA: dict[str, tuple[V, V | None, Any]] = {
    "test.u8": (V.UINT8, None, 200),
    "test.i8": (V.INT8, None, -100),
    "test.u16": (V.UINT16, None, 60000),
    "test.i16": (V.INT16, None, -30000),
    "test.u32": (V.UINT32, None, 4_000_000_000),
    "test.i32": (V.INT32, None, -2_000_000_000),
    "test.f32": (V.FLOAT32, None, 0.5),
    "test.bool": (V.BOOL, None, True),
    "test.string": (V.STRING, None, "héllo, wörld"),
    "test.u64": (V.UINT64, None, 2**64 - 1),
    "test.i64": (V.INT64, None, -(2**63)),
    "test.f64": (V.FLOAT64, None, 1e300),
    "test.arr_i32": (V.ARRAY, V.INT32, [1, -2, 3]),
    "test.arr_f32": (V.ARRAY, V.FLOAT32, [0.25, -1.5, 3.0]),
    "test.arr_u64": (V.ARRAY, V.UINT64, [0, 2**64 - 1]),
    "test.arr_bool": (V.ARRAY, V.BOOL, [True, False, True]),
    "test.arr_u8": (V.ARRAY, V.UINT8, [0, 255, 7]),
    "test.arr_f64": (V.ARRAY, V.FLOAT64, [1.0, -0.1]),
    "tokenizer.ggml.tokens": (V.ARRAY, V.STRING, ["<s>", "</s>", "héllo", "", "▁the"]),
    "tokenizer.ggml.scores": (V.ARRAY, V.FLOAT32, [float(i) / 4 for i in range(1000)]),
    "test.nested": (V.ARRAY, V.ARRAY, [[1, 2], [3]]),
}


def _sample_tensors(rng: np.random.Generator) -> dict[str, tuple[Q, np.ndarray]]:
    """name -> (ggml type, the array handed to the writer: values, or raw uint8 blocks)."""

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    def raw_blocks(qtype: Q, *shape: int) -> np.ndarray:
        block, type_size = GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (*shape[:-1], shape[-1] // block * type_size), dtype=np.uint8)

    return {
        "token_embd.weight": (Q.F32, f32(8, 64)),
        "output_norm.weight": (Q.F32, f32(64)),
        "blk.0.attn_q.weight": (Q.F16, f32(4, 3, 64).astype(np.float16)),
        "blk.0.attn_k.weight": (Q.BF16, quantize(f32(2, 64), Q.BF16)),
        "blk.0.attn_v.weight": (Q.Q8_0, quantize(f32(4, 64), Q.Q8_0)),
        "blk.0.ffn_up.weight": (Q.Q4_0, quantize(f32(2, 64), Q.Q4_0)),
        "blk.0.ffn_down.weight": (Q.Q4_K, raw_blocks(Q.Q4_K, 2, 512)),
        "blk.0.ffn_gate.weight": (Q.Q6_K, raw_blocks(Q.Q6_K, 3, 256)),
        "four_d": (Q.F32, f32(2, 1, 3, 5)),
        "f64": (Q.F64, rng.standard_normal(7)),
        "i8": (Q.I8, rng.integers(-128, 128, 9, dtype=np.int8)),
        "i16": (Q.I16, rng.integers(-1000, 1000, (3, 2), dtype=np.int16)),
        "i32": (Q.I32, rng.integers(-(2**31), 2**31, 5, dtype=np.int32)),
        "i64": (Q.I64, rng.integers(-(2**62), 2**62, 3, dtype=np.int64)),
    }


def write_sample(
    path: Path, *, alignment: int | None = None, endianess: GGUFEndian = GGUFEndian.LITTLE, seed: int = 0
) -> dict[str, tuple[Q, np.ndarray]]:
    """Write a small GGUF model to ``path``; return name -> (ggml type, array written)."""
    tensors = _sample_tensors(np.random.default_rng(seed))
    w = GGUFWriter(path, arch="llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vtype, sub, value) in SAMPLE_METADATA.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    _finish(w, tensors)
    return tensors


def _finish(w: GGUFWriter, tensors: dict[str, tuple[Q, np.ndarray]]) -> None:
    for name, (qtype, arr) in tensors.items():
        raw = qtype not in (Q.F32, Q.F16, Q.F64, Q.I8, Q.I16, Q.I32, Q.I64)
        w.add_tensor(name, arr, raw_dtype=qtype if raw else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_split_sample(path: Path, *, max_tensors: int = 4, seed: int = 0) -> list[Path]:
    """The sample model split by gguf-py's writer, ``max_tensors`` tensors a file, as
    ``<stem>-00001-of-0000N.gguf`` and on beside ``path``; returns those files in order."""
    w = GGUFWriter(path, arch="llama", split_max_tensors=max_tensors)
    w.add_key_value("test.string", "héllo", V.STRING)
    _finish(w, _sample_tensors(np.random.default_rng(seed)))
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))


def write_split_file(path: Path, names: list[str], split: dict[str, int], *, seed: int = 0) -> None:
    """One file of a split model whose split keys (``split.no`` and so on, each an integer) the
    caller chooses, holding the named sample tensors: for broken sets."""
    sample = _sample_tensors(np.random.default_rng(seed))
    w = GGUFWriter(path, arch="llama")
    for key, value in split.items():
        w.add_key_value(key, value, V.INT32 if key == "split.tensors.count" else V.UINT16)
    _finish(w, {n: sample[n] for n in names})


SAMPLE_NAMES = list(_sample_tensors(np.random.default_rng(0)))


# ---- hand packing, independent of GGUFWriter ----


def s(text: str | bytes) -> bytes:
    """A GGUF string: u64 length, then the bytes."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, value: int) -> bytes:
    return s(key) + struct.pack("<II", V.UINT32, value)


def kv_str(key: str, value: str) -> bytes:
    return s(key) + struct.pack("<I", V.STRING) + s(value)


def tensor_info(name: str, ne: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    return s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset)


def pack(
    kvs: list[bytes],
    tensors: list[bytes],
    *,
    data: bytes = b"",
    version: int = 3,
    alignment: int = 32,
    magic: bytes = b"GGUF",
) -> bytes:
    """A whole file: header, padding to ``alignment``, then ``data``."""
    head = magic + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return head + bytes(-len(head) % alignment) + data
