"""Checkpoints for tests: tensors of every dtype, written by the one synthetic-checkpoint writer
(:func:`weightlift.benchmark.synthetic.write_checkpoint`), single files and sharded sets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from weightlift.benchmark.synthetic import write_checkpoint
from weightlift.dtypes import DTYPES, byte_length

# one shape per dtype; sub-byte types need whole bytes
SHAPES: dict[str, tuple[int, ...]] = {d.name: (3, 5) for d in DTYPES}
SHAPES.update({"F4": (4, 6), "F6_E2M3": (4, 4), "F6_E3M2": (2, 8), "F64": (), "I8": (0, 4), "U16": (7,)})


def every_dtype(seed: int = 0) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """(name, dtype, shape, raw bytes) for every dtype safetensors defines, 0-d and empty included."""
    rng = np.random.default_rng(seed)
    out = []
    for d in DTYPES:
        shape = SHAPES[d.name]
        n = byte_length(d.name, shape)
        raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if d.name == "BOOL":
            raw = bytes(b & 1 for b in raw)
        out.append((f"t.{d.name.lower()}", d.name, shape, raw))
    return out


def write(
    path: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict[str, str] | None = None
) -> Path:
    """A .safetensors file holding exactly these tensors' bytes."""
    write_checkpoint(path, tensors, metadata=metadata)
    return path


def write_sharded(folder: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]], shards: int) -> Path:
    """transformers' layout: model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    per = -(-len(tensors) // shards)
    for i in range(shards):
        part = tensors[i * per : (i + 1) * per]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write(folder / name, part)
        weight_map.update({t[0]: name for t in part})
    idx = folder / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {"total_size": sum(len(t[3]) for t in tensors)}, "weight_map": weight_map}))
    return idx


def raw_bytes(x: object) -> bytes:
    """The bytes behind a numpy array or torch tensor (any dtype, any shape)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    import torch

    t = x.detach().cpu().contiguous()  # type: ignore[attr-defined]
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()
