"""Synthetic checkpoints: the one writer of safetensors files for the demo, the benchmark and the tests.

A tensor to write is ``(name, dtype, shape)``, filled with deterministic pseudo-random bytes from
``seed``, or ``(name, dtype, shape, data)`` with its exact bytes (the tests' golden tensors). The
file is written under a temporary name and renamed into place, so a reader never sees half a
checkpoint and two processes making the same one do not collide. The layouts are shaped like a
Llama model (BF16 weights, F32 norms), so the loads measured look like real ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from weightlift import env
from weightlift.dtypes import byte_length
from weightlift.formats.safetensors import build_header

__all__ = [
    "Tensor",
    "llama_tensors",
    "llama_for_size",
    "moe_tensors",
    "write_checkpoint",
    "demo_dir",
    "demo_tensors",
    "ensure_demo_checkpoint",
]

MIB = 1 << 20
GIB = 1 << 30
DEMO_NAME = "demo-llm-1g"  # the demo's checkpoint, under the cache folder
_CHUNK = 64 * MIB  # random bytes are made and written this much at a time

Tensor = tuple[str, str, tuple[int, ...]] | tuple[str, str, tuple[int, ...], bytes]


def llama_tensors(
    *, layers: int = 8, hidden: int = 2048, inter: int = 5632, vocab: int = 32000, kv: int = 256
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of a Llama-shaped model: BF16 weights, F32 norms."""
    out: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", "F32", (hidden,)),
            (p + "self_attn.q_proj.weight", "BF16", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", "BF16", (kv, hidden)),
            (p + "self_attn.v_proj.weight", "BF16", (kv, hidden)),
            (p + "self_attn.o_proj.weight", "BF16", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", "F32", (hidden,)),
            (p + "mlp.gate_proj.weight", "BF16", (inter, hidden)),
            (p + "mlp.up_proj.weight", "BF16", (inter, hidden)),
            (p + "mlp.down_proj.weight", "BF16", (hidden, inter)),
        ]
    out += [("model.norm.weight", "F32", (hidden,)), ("lm_head.weight", "BF16", (vocab, hidden))]
    return out


def llama_for_size(size: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A Llama-shaped layout of about ``size`` bytes: the hidden size grows with the checkpoint,
    then as many layers as fit beside the embedding and the head."""
    h = 2048 if size >= GIB else 1024 if size >= 128 * MIB else 128
    ff = (h * 11 // 4 + 63) // 64 * 64
    layer = 4 * h * h * 2 + 3 * h * ff * 2 + 2 * h * 4
    vocab = max(64, int(size * 0.12) // (h * 2))
    layers = max(1, (size - 2 * vocab * h * 2) // layer)
    return llama_tensors(layers=layers, hidden=h, inter=ff, vocab=vocab, kv=h)


def moe_tensors(
    *, layers: int = 4, experts: int = 16, hidden: int = 1024, vocab: int = 8192
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of a mixture-of-experts decoder whose experts are small, as in real MoE
    checkpoints: per layer an attention block, a router and ``experts`` experts of three
    projections each (1 to 8 MiB per tensor at the defaults), between an embedding and a head of
    16 MiB each. The defaults make about 0.5 GiB in about 200 tensors."""
    out: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", "F32", (hidden,)),
            (p + "self_attn.qkv_proj.weight", "BF16", (3 * hidden, hidden)),
            (p + "self_attn.o_proj.weight", "BF16", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", "F32", (hidden,)),
            (p + "mlp.gate.weight", "BF16", (experts, hidden)),
        ]
        for e in range(experts):
            inter = 512 * (1 + (e * 7 + i) % 4)  # 512..2048 rows: 1 to 4 MiB per projection
            q = f"{p}mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", "BF16", (inter, hidden)),
                (q + "up_proj.weight", "BF16", (inter, hidden)),
                (q + "down_proj.weight", "BF16", (hidden, inter)),
            ]
    out += [("model.norm.weight", "F32", (hidden,)), ("lm_head.weight", "BF16", (vocab, hidden))]
    return out


def write_checkpoint(
    path: str | os.PathLike[str],
    tensors: Sequence[Tensor],
    *,
    seed: int = 0,
    metadata: dict[str, str] | None = None,
    digests: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, str]:
    """Write a .safetensors file of ``tensors``; returns the BLAKE3 hex digest per tensor with
    ``digests``. ``progress(bytes written, bytes in all)`` is told after each piece of data."""
    entries = [(t[0], t[1], tuple(t[2]), len(t[3]) if len(t) == 4 else byte_length(t[1], tuple(t[2]))) for t in tensors]
    header, _ = build_header(entries, metadata)
    rng = np.random.default_rng(seed)
    hasher: Any = None
    if digests:
        import blake3

        hasher = blake3.blake3
    out: dict[str, str] = {}
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        total, done = sum(e[3] for e in entries), 0
        with open(tmp, "wb") as f:
            f.write(header)
            for t, (name, _, _, n) in zip(tensors, entries, strict=False):
                h = hasher() if hasher is not None else None
                for piece in _pieces(t, n, rng):
                    f.write(piece)
                    if h is not None:
                        h.update(piece)
                    if progress is not None:
                        done += len(piece)
                        progress(done, total)
                if h is not None:
                    out[name] = h.hexdigest()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out


def _pieces(t: Tensor, n: int, rng: np.random.Generator) -> Any:
    if len(t) == 4:
        yield t[3]
        return
    while n > 0:
        k = min(n, _CHUNK)
        words = rng.integers(0, 2**63, size=(k + 7) // 8, dtype=np.uint64)
        yield words.data.cast("B")[:k]
        n -= k


def demo_dir() -> Path:
    """Where the demo checkpoint and its digests live: under weightlift's cache folder."""
    return Path(env.cache_dir()) / DEMO_NAME


def demo_tensors(*, layers: int = 8) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the demo's Llama-shaped model: BF16 weights, F32 norms."""
    return llama_tensors(layers=layers)


def ensure_demo_checkpoint(*, layers: int = 8, progress: Callable[[int, int], None] | None = None) -> Path:
    """The demo checkpoint's path, written on first use and reused afterwards; ``progress`` as
    :func:`write_checkpoint`'s, told only when it is written."""
    d = demo_dir()
    path = d / "model.safetensors"
    sums = d / "digests.json"
    if path.exists() and sums.exists():
        return path
    d.mkdir(parents=True, exist_ok=True)
    print(f"writing the demo checkpoint (once): {path}")
    digests = write_checkpoint(
        path,
        demo_tensors(layers=layers),
        metadata={"format": "pt", "weightlift": "demo"},
        digests=True,
        progress=progress,
    )
    sums.write_text(json.dumps(digests, indent=0))
    return path
