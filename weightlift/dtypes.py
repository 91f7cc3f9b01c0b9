"""Element types: the safetensors names, their sizes, and the numpy / torch types they map to.

safetensors names its dtypes with short strings ("BF16", "F8_E4M3"); that string is the
canonical name inside weightlift and on the wire. numpy has no bfloat16 or float8, so numpy
results use the ``ml_dtypes`` types for them. Sub-byte types (F4, F6_*) are packed several to
a byte: they come back as their raw packed bytes (``uint8``), since neither numpy nor torch has
a portable unpacked view of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from weightlift.errors import FormatError, OptionError

__all__ = [
    "DType",
    "DTYPES",
    "dtype_info",
    "item_size",
    "numpy_dtype",
    "torch_dtype",
    "byte_length",
    "from_numpy",
    "from_torch",
]


@dataclass(frozen=True, slots=True)
class DType:
    """One element type: its name, its width in bits, and the names of its numpy / torch types."""

    name: str
    bits: int
    numpy: str  # numpy or ml_dtypes type name; "" for packed sub-byte types
    torch: str  # torch attribute name; "" where torch has none


# Codes on the wire are the position in this table: append only.
DTYPES: tuple[DType, ...] = (
    DType("BOOL", 8, "bool", "bool"),
    DType("U8", 8, "uint8", "uint8"),
    DType("I8", 8, "int8", "int8"),
    DType("F8_E5M2", 8, "float8_e5m2", "float8_e5m2"),
    DType("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn"),
    DType("I16", 16, "int16", "int16"),
    DType("U16", 16, "uint16", "uint16"),
    DType("F16", 16, "float16", "float16"),
    DType("BF16", 16, "bfloat16", "bfloat16"),
    DType("I32", 32, "int32", "int32"),
    DType("U32", 32, "uint32", "uint32"),
    DType("F32", 32, "float32", "float32"),
    DType("F64", 64, "float64", "float64"),
    DType("I64", 64, "int64", "int64"),
    DType("U64", 64, "uint64", "uint64"),
    DType("C64", 64, "complex64", "complex64"),
    DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz"),
    DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz"),
    DType("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu"),
    DType("F4", 4, "", ""),
    DType("F6_E2M3", 6, "", ""),
    DType("F6_E3M2", 6, "", ""),
)

_BY_NAME = {d.name: d for d in DTYPES}
CODES = {d.name: i for i, d in enumerate(DTYPES)}


def dtype_info(name: str) -> DType:
    """The DType called ``name``; OptionError if there is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise OptionError(f"unknown dtype {name!r}") from None


def item_size(name: str) -> int:
    """Bytes per element; 0 for sub-byte dtypes (a delta codec's planes need whole bytes)."""
    bits = dtype_info(name).bits
    return bits // 8 if bits % 8 == 0 else 0


def byte_length(name: str, shape: tuple[int, ...], *, file: str | None = None, tensor: str | None = None) -> int:
    """Bytes a tensor of this dtype and shape occupies; FormatError if it is not whole bytes."""
    d = _BY_NAME.get(name)
    if d is None:
        raise FormatError(f"unknown dtype {name!r}", file=file, tensor=tensor)
    n = 1
    for s in shape:
        n *= s
    bits = n * d.bits
    if bits % 8:
        raise FormatError(f"{n} elements of {name} are not a whole number of bytes", file=file, tensor=tensor)
    return bits // 8


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for ``name`` (ml_dtypes for bfloat16 and float8; uint8 for packed types)."""
    d = dtype_info(name)
    if not d.numpy:
        return np.dtype(np.uint8)
    if hasattr(np, d.numpy) and d.numpy not in ("bool",):
        return np.dtype(d.numpy)
    if d.numpy == "bool":
        return np.dtype(np.bool_)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, d.numpy))


def torch_dtype(name: str) -> Any:
    """The torch dtype for ``name``; uint8 for packed types; OptionError where torch lacks it."""
    import torch

    d = dtype_info(name)
    if not d.torch:
        return torch.uint8
    t = getattr(torch, d.torch, None)
    if t is None:
        raise OptionError(f"this torch has no dtype for {name}")
    return t


def from_numpy(dt: np.dtype) -> str:
    """The dtype name of a numpy dtype; OptionError if there is none."""
    dt = np.dtype(dt)
    for d in DTYPES:
        if d.numpy and d.bits % 8 == 0:
            try:
                if numpy_dtype(d.name) == dt:
                    return d.name
            except (ImportError, AttributeError, TypeError):
                continue
    raise OptionError(f"numpy dtype {dt} has no safetensors name")


def from_torch(dt: Any) -> str:
    """The dtype name of a torch dtype; OptionError if there is none."""
    import torch

    for d in DTYPES:
        if d.torch and getattr(torch, d.torch, None) == dt:
            return d.name
    raise OptionError(f"torch dtype {dt} has no safetensors name")
