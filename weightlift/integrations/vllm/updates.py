"""What a weight update may feed a running vLLM model: the checks made before any tensor of it
reaches the weight loaders (no vLLM needed here, so they are tested without it).

An update is held to the checkpoint the engine was started on: every tensor's name must be one
of it and its shape the same, and a decoder layer goes whole. vLLM's layerwise reload processes
a layer (repacking, quantization) once the elements of all its parameters are loaded; a layer
given only some of its checkpoint tensors (``q_proj`` without the ``k_proj`` and ``v_proj`` of
the fused ``qkv_proj``, one expert of a fused MoE layer) would be processed with the rest of
its fresh memory unset, and serve garbage. So a name brings every other tensor of its decoder
layer that the server holds, and an update is refused where the server lacks one.
"""

from __future__ import annotations

import os
import re
from typing import Any

from weightlift.checkpoint import open_checkpoint
from weightlift.errors import OptionError

__all__ = ["checked", "checkpoint_shapes", "layer_key", "whole_layers"]

Shapes = dict[str, tuple[int, ...]]

#: checkpoint tensors vLLM's models skip when they load (rotary tables some checkpoints carry)
NOT_LOADED = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
SHOWN = 8  # names an error lists before it says how many more


def _some(names: list[str]) -> str:
    more = f" (and {len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def checkpoint_shapes(model: str) -> Shapes | None:
    """Every tensor's shape in the checkpoint at ``model`` (headers only), or None where it is
    not a local safetensors checkpoint: then updates are checked by vLLM's loaders alone."""
    if not os.path.isdir(model):
        return None
    try:
        return {t.name: tuple(t.shape) for t in open_checkpoint(model).tensors}
    except Exception:  # not ours to read: vLLM loaded it its own way
        return None


def layer_key(name: str) -> str:
    """The decoder layer a checkpoint name belongs to: the name up to its first number
    (``model.layers.3``), or the whole name where it has none (embeddings, the final norm)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def whole_layers(names: list[str], held: dict[str, Any], expected: Shapes) -> list[str]:
    """``names`` and every other tensor of their decoder layers, in name order (a layer's
    tensors together); OptionError if the server lacks one."""
    keys = {layer_key(n) for n in names}
    need = [n for n in expected if layer_key(n) in keys and not NOT_LOADED.search(n)]
    lacking = [n for n in need if n not in held]
    if lacking:
        raise OptionError(f"weight update refused: a layer is reloaded whole, and the server lacks {_some(lacking)}")
    return sorted(set(names) | set(need))


def checked(held: dict[str, Any], names: list[str], expected: Shapes | None) -> list[tuple[str, Any]]:
    """``(name, tensor)`` for ``names`` and the rest of their decoder layers; OptionError if one
    is not held, not in the checkpoint (``expected``; None: no such checks, and a layer is what
    the server holds of it), or (any of the layers' tensors) of another shape there."""
    if not names:
        raise OptionError("weight update refused: the server holds no tensors (push them first)")
    if not all(isinstance(n, str) for n in names):
        raise OptionError(
            f"weight update refused: names must be strings, not {sorted({type(n).__name__ for n in names})}"
        )
    missing = [n for n in names if n not in held]
    if missing:
        raise OptionError(f"weight update refused: not on the server: {_some(missing)}")
    if expected is None:  # no checkpoint to say what a layer holds: what the server holds of it
        keys = {layer_key(n) for n in names}
        return [(n, held[n]) for n in sorted(set(names) | {n for n in held if layer_key(n) in keys})]
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise OptionError(f"weight update refused: not in the model's checkpoint: {_some(unknown)}")
    names = whole_layers(names, held, expected)  # the tensors a layer brings are checked as the named
    wrong = [
        f"{n} {tuple(held[n].shape)} (the model's is {expected[n]})"
        for n in names
        if tuple(held[n].shape) != expected[n]
    ]
    if wrong:
        raise OptionError(f"weight update refused: shapes differ: {_some(wrong)}")
    return [(n, held[n]) for n in names]
