"""transformers' table of name conversions, built with each regular expression compiled at its first use.

transformers compiles every model's renamings (about 1,200 regular expressions in 5.x) on the
first load of a process, most of a warm load's own Python time, for the one model's handful that
will ever match a name. :func:`lazy_conversion_table` builds the same table first, with
``re.compile`` deferred per pattern (:class:`LazyPattern`); transformers' own loads in the
process then use it too.
"""

from __future__ import annotations

import re as _re
import threading
from typing import Any

__all__ = ["LazyPattern", "lazy_conversion_table"]


class LazyPattern:
    """A regular expression compiled at its first use; otherwise it acts as the compiled one."""

    __slots__ = ("_args", "_compiled")

    def __init__(self, *args: Any) -> None:
        self._args = args
        self._compiled: Any = None

    def _get(self) -> Any:
        if self._compiled is None:
            self._compiled = _re.compile(*self._args)
        return self._compiled

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __copy__(self) -> LazyPattern:
        return self  # immutable, as a compiled pattern is (copy and deepcopy return it too)

    def __deepcopy__(self, memo: Any) -> LazyPattern:
        return self

    def __reduce__(self) -> Any:
        return (_re.compile, self._args)

    def __repr__(self) -> str:
        return repr(self._get())


class _LazyRe:
    """transformers' ``core_model_loading.re`` while it builds its table: ``compile`` is lazy for
    the building thread only; any other thread running that module meanwhile gets ``re`` itself."""

    def __init__(self) -> None:
        self._builder = threading.get_ident()

    def __getattr__(self, name: str) -> Any:
        return getattr(_re, name)

    def compile(self, *args: Any) -> Any:
        return LazyPattern(*args) if threading.get_ident() == self._builder else _re.compile(*args)


_lazy_lock = threading.Lock()


def lazy_conversion_table() -> None:
    """Build transformers' table of name conversions with each regular expression compiled at
    its first use.

    The table holds every model's renamings (about 1,200 of them, in transformers 5.x) and
    transformers builds it, once per process, on the first load, compiling each one: 0.09-0.13 s
    on this project's machine, most of a warm load's own time, for the one model's handful
    that will ever match a name. Built here first, with ``re.compile`` deferred, it is the same
    table (the same conversions, in the same order, each pattern compiled from the same text
    when it is first matched), and transformers' own loads in this process use it too. A
    transformers whose module does not look as expected is left to build its table itself.
    """
    try:
        from transformers import conversion_mapping as cm
        from transformers import core_model_loading as cml
    except ImportError:
        return
    if (
        getattr(cm, "_checkpoint_conversion_mapping_cache", False) is not None
        or not callable(getattr(cm, "_build_checkpoint_conversion_mapping", None))
        or getattr(cml, "re", None) is not _re
    ):
        return
    with _lazy_lock:
        if cm._checkpoint_conversion_mapping_cache is not None:
            return
        cml.re = _LazyRe()
        try:
            table = cm._build_checkpoint_conversion_mapping()
        finally:
            cml.re = _re
        if cm._checkpoint_conversion_mapping_cache is None:
            cm._checkpoint_conversion_mapping_cache = table
