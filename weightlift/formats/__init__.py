"""Pure format parsers: header bytes in, tensor descriptions out. No file or device I/O here.

Each parser turns the bytes of a header into :class:`TensorInfo` records that say where each
tensor's bytes lie (file, absolute offset, length). Reading those bytes is the loader's job.
Every offset and length is checked against the file size and named limits before it is
trusted, so a loader never reads outside a file or hands back a tensor of the wrong size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TensorInfo", "check_layout"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes lie, and how to read them.

    ``dtype`` is a safetensors dtype name ("BF16") for safetensors and for GGUF's plain types;
    for GGUF quantized tensors it is the ggml type name ("Q4_K") and ``shape`` is the logical
    shape in numpy order, while the bytes are the raw blocks. ``offset`` is absolute in ``file``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    length: int
    ggml_type: int | None = None
    alignment: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def quantized(self) -> bool:
        return self.ggml_type is not None and self.dtype not in _PLAIN_GGML


# GGML types whose bytes are plain arrays with a safetensors dtype name.
_PLAIN_GGML = frozenset({"F32", "F16", "BF16", "I8", "I16", "I32", "I64", "F64"})


def check_layout(tensors: list[TensorInfo], *, file: str, data_start: int, file_size: int) -> None:
    """Every tensor lies inside [data_start, file_size) and no two overlap; FormatError otherwise."""
    from ..errors import FormatError

    for t in tensors:
        if t.offset < data_start or t.length < 0 or t.end > file_size:
            raise FormatError(
                f"bytes [{t.offset}, {t.end}) lie outside the data region [{data_start}, {file_size})",
                file=file,
                tensor=t.name,
            )
    ordered = sorted((t for t in tensors if t.length), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if b.offset < a.end:
            raise FormatError(f"bytes overlap those of tensor {a.name!r}", file=file, tensor=b.name)
