"""The options of a load as one value: where tensors land (:class:`Placement`) and how (:class:`LoadOptions`).

``weightlift.load`` keeps its keyword face; it builds one :class:`LoadOptions` from the keywords,
which checks every value once, and hands that value down: the local loader, the split load, the
distributed load and the transformers integration read the same fields instead of passing
loose keywords along. :class:`Placement` is the device/framework pair on its own, checked once:
the layers that take only that (the targets, the tensor server, the broadcast load) are handed
the value, never its device string to parse again.

The keywords are written once, as the fields of an options dataclass (their defaults, their
checks); the typed face of a function that takes them is a ``TypedDict`` of the same names
(``**options: Unpack[...]``, PEP 692), pinned to the fields by a test. :func:`check_keywords` refuses a
keyword that is not a field as Python would, and :func:`keyword_signature` gives the function the
full signature ``help()`` and ``inspect`` show.

Which kind of load a call is, and which options each kind supports, is :mod:`weightlift.api`'s
table; this module only says what each option may hold.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from re import Pattern
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from weightlift.dtypes import DTYPES, from_numpy, from_torch
from weightlift.errors import OptionError

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch
    import torch.distributed
    from numpy.typing import NDArray

    from weightlift.profile import Profiler

__all__ = [
    "Placement",
    "LoadOptions",
    "Select",
    "Array",
    "DTypeLike",
    "Group",
    "ProfileLike",
    "ENGINES",
    "PAGE_CACHE",
    "FRAMEWORKS",
    "dtype_name",
    "check_keywords",
    "keyword_signature",
]

#: Which tensors: a glob, globs, ``"re:<regex>"``, a compiled regex, or exact names (a frozenset).
Select: TypeAlias = None | str | Pattern[str] | Iterable[str] | frozenset[str]
#: A dtype to cast floating-point tensors to: a name ("F16", "bfloat16"), a numpy or a torch dtype.
DTypeLike: TypeAlias = Union[str, "np.dtype[np.generic]", "type[np.generic]", "torch.dtype"]
#: A loaded tensor: a numpy array (``framework="numpy"``) or a torch tensor (``framework="torch"``).
Array: TypeAlias = Union["NDArray[np.generic]", "torch.Tensor"]
#: A torch.distributed process group.
Group: TypeAlias = "torch.distributed.ProcessGroup"
#: The profiler switch: on, off, from the environment (None), or a profiler of the caller's.
ProfileLike: TypeAlias = Union[bool, "Profiler", None]

FRAMEWORKS = ("numpy", "torch")
ENGINES = ("auto", "pread", "mmap")
PAGE_CACHE = (None, "keep", "evict")
_CUDA = re.compile(r"cuda(:\d+)?")
_PLAIN = {d.name for d in DTYPES}


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where tensors land: ``device`` "cpu" or "cuda[:N]", ``framework`` "numpy" or "torch".

    Checked once, here, without importing torch: CUDA needs ``framework="torch"``. Whether the
    device exists is the target's to find out (:class:`~weightlift.memory.targets.CudaTarget`,
    a DeviceError), when memory is first needed on it.
    """

    device: str = "cpu"
    framework: str = "numpy"

    def __post_init__(self) -> None:
        dev = str(self.device)  # a torch.device is welcome too
        object.__setattr__(self, "device", dev)
        if self.framework not in FRAMEWORKS:
            raise OptionError(f"framework must be 'numpy' or 'torch', not {self.framework!r}")
        if dev == "cpu":
            return
        if dev.startswith("cuda"):
            if self.framework != "torch":
                raise OptionError(f"device {dev!r} needs framework='torch'")
            if _CUDA.fullmatch(dev):
                return
        raise OptionError(f"unknown device {dev!r}: expected 'cpu' or 'cuda[:N]'")

    @property
    def cuda(self) -> bool:
        """Device memory (not host-addressable), as opposed to host memory."""
        return self.device != "cpu"

    @property
    def index(self) -> int | None:
        """The CUDA device's number where the device names one ("cuda:1"), else None."""
        _, sep, n = self.device.partition(":")
        return int(n) if sep else None


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """Everything :func:`weightlift.load` takes besides the path, checked once.

    The fields are ``load``'s keywords and their defaults, written here once (``load`` takes them
    as ``**options`` typed by :class:`weightlift.api.LoadKw`); what each means is said in ``load``'s
    docstring. ``placement`` and ``cast`` are derived: the checked device/framework pair and the
    dtype's name (None: no cast). Build a variant with :func:`dataclasses.replace`, which checks
    it again.
    """

    device: str = "cpu"
    framework: str = "numpy"
    select: Select = None
    dtype: DTypeLike | None = None
    copy: bool = True
    page_cache: str | None = None
    warm: bool | None = None
    threads: int | None = None
    engine: str = "auto"
    dequantize: bool = False
    profile: ProfileLike = None
    progress: bool | None = None
    report: dict[str, Any] | None = None
    remote: Mapping[str, Select] | None = None
    token: str | bytes | None = field(default=None, repr=False)  # a secret: never in a log line or a traceback
    streams: int = 1
    #: a :class:`weightlift.Shard` (typed in ``load``'s signature; the distributed layer sits above this one)
    shard: object | None = None
    group: Group | None = None
    verify: bool = False
    #: a published manifest: its path, or a :class:`weightlift.digest.published.Manifest`
    manifest: str | os.PathLike[str] | object | None = None

    placement: Placement = field(init=False, repr=False, compare=False)
    cast: str | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement(device=self.device, framework=self.framework))
        object.__setattr__(self, "device", self.placement.device)
        if self.engine not in ENGINES:
            raise OptionError(f"engine must be 'auto', 'pread' or 'mmap', not {self.engine!r}")
        if self.page_cache not in PAGE_CACHE:
            raise OptionError(f"page_cache must be 'keep' or 'evict', not {self.page_cache!r}")
        if self.threads is not None:
            object.__setattr__(self, "threads", int(self.threads))
            if self.threads < 1:
                raise OptionError("threads must be at least 1")
        object.__setattr__(self, "cast", dtype_name(self.dtype))
        if self.cast is not None and not _is_float(self.cast):
            # only floating-point tensors are cast: a float cast to an integer would lose every
            # fraction without a word
            raise OptionError(f"dtype={self.dtype!r}: a cast is to a floating-point dtype (F16, BF16, F32...)")
        if not self.copy and (self.placement.cuda or self.cast is not None):
            raise OptionError("copy=False returns views of the file's mapping: only for device='cpu' without dtype")

    def given(self) -> list[str]:
        """The options set to something other than their default, in field order."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.init and getattr(self, f.name) != f.default and not _off(f.name, getattr(self, f.name))
        ]


def _is_float(name: str) -> bool:
    return next(d for d in DTYPES if d.name == name).numpy.startswith(("float", "bfloat"))


def _off(name: str, value: object) -> bool:
    # an empty remote mapping is no split load; profile=False is the profiler off, as by default
    return (name == "remote" and not value) or (name == "profile" and value is False)


def dtype_name(dtype: DTypeLike | None) -> str | None:
    """The dtype name ("F16", "BF16", ...) of a dtype given by name, numpy dtype or torch dtype."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        up = dtype.upper()
        if up in _PLAIN:
            return up
        try:
            return from_numpy(np.dtype(dtype))
        except (TypeError, OptionError):
            pass
        try:
            import ml_dtypes

            return from_numpy(np.dtype(getattr(ml_dtypes, dtype)))
        except (AttributeError, TypeError, ImportError, OptionError):
            raise OptionError(f"unknown dtype {dtype!r}") from None
    if type(dtype).__module__.startswith("torch"):
        return from_torch(dtype)
    try:
        return from_numpy(np.dtype(dtype))
    except TypeError:
        raise OptionError(f"unknown dtype {dtype!r}") from None


def _fields(options: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(options) if f.init]


def check_keywords(where: str, given: Iterable[str], options: Any) -> None:
    """A TypeError worded as Python's own for a keyword in ``given`` that is not one of the
    ``options`` dataclass's fields: a function taking ``**options`` refuses what it did not name,
    as it did when it named each keyword itself."""
    known = {f.name for f in _fields(options)}
    for name in given:
        if name not in known:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


def keyword_signature(fn: Callable[..., object], options: Any, typed: Any) -> inspect.Signature:
    """``fn``'s signature with its ``**options`` written out as the keyword-only parameters they
    are: the fields of the ``options`` dataclass, in order and with their defaults, annotated as
    the ``typed`` TypedDict types them. A keyword ``fn`` names itself keeps its place among them."""
    sig = inspect.signature(fn)
    kw_only, var_kw = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD
    own = {n: p for n, p in sig.parameters.items() if p.kind is kw_only}
    params = [p for p in sig.parameters.values() if p.kind not in (kw_only, var_kw)]
    for f in _fields(options):
        if f.name in own:
            params.append(own[f.name])
            continue
        hint = typed.__annotations__.get(f.name, f.type)
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        ann = getattr(hint, "__forward_arg__", hint)  # the annotation as written, as for a plain keyword
        params.append(inspect.Parameter(f.name, kw_only, default=default, annotation=ann))
    return sig.replace(parameters=params)
