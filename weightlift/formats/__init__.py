"""Pure format parsers: header bytes in, tensor descriptions out. No file or device I/O here.

Each parser turns the bytes of a header into :class:`TensorInfo` records that say where each
tensor's bytes lie (file, absolute offset, length). Reading those bytes is the loader's job.
Every offset and length is checked against the file size and named limits before it is
trusted, so a loader never reads outside a file or hands back a tensor of the wrong size.

Each parser accepts what its format's reference implementation accepts and refuses what it
refuses; where one deliberately refuses more, its module docstring says so and why. One such
rule is shared: :data:`MAX_EXTENT` bounds even empty tensors, whose shapes the file size does
not bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TensorInfo", "check_layout", "check_extent", "MAX_EXTENT"]

# The most elements a shape may describe, counting only its non-zero dimensions. numpy refuses
# any array, even an empty one, whose non-zero dimensions times its item size pass 2**63 - 1
# bytes, and a load may view or cast a tensor to items of up to 8 bytes (F64, I64, C64): without
# this bound a shape like (0, 2**62), which holds no bytes at all, opens but never loads. The
# file size bounds every other shape far below this.
MAX_EXTENT = (1 << 60) - 1


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


def check_extent(shape: tuple[int, ...], *, file: str, tensor: str) -> None:
    """FormatError if the non-zero dimensions of ``shape`` multiply past :data:`MAX_EXTENT`."""
    extent = 1
    for d in shape:
        if d:
            extent *= d
            if extent > MAX_EXTENT:
                from weightlift.errors import FormatError

                raise FormatError(
                    f"shape {list(shape)} is too large: its non-zero dimensions multiply to 2**60 or more,"
                    " more than a load can describe as an array, even an empty one",
                    file=file,
                    tensor=tensor,
                )


def check_layout(
    tensors: list[TensorInfo], *, file: str, data_start: int, file_size: int, empty_anywhere: bool = False
) -> None:
    """Every tensor lies inside [data_start, file_size) and no two overlap; FormatError otherwise.

    ``empty_anywhere`` lets a tensor of no bytes name any offset from data_start on, even past
    the end of the file (GGUF: gguf's reader takes it, there being nothing to read)."""
    from weightlift.errors import FormatError

    for t in tensors:
        if empty_anywhere and t.length == 0 and t.offset >= data_start:
            continue
        if t.offset < data_start or t.length < 0 or t.end > file_size:
            raise FormatError(
                f"bytes [{t.offset}, {t.end}) lie outside the data region [{data_start}, {file_size})",
                file=file,
                tensor=t.name,
            )
    ordered = sorted((t for t in tensors if t.length), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.offset < a.end:
            raise FormatError(f"bytes overlap those of tensor {a.name!r}", file=file, tensor=b.name)
