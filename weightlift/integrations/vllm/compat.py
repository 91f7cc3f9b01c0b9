"""Every use of a vLLM internal, behind one fence: the vLLM releases it was tested on.

The load format stands on vLLM's public extension points only (``register_model_loader`` and
``BaseModelLoader``, the weight-transfer engine registry, ``LoadConfig``'s
``model_loader_extra_config`` and ``safetensors_load_strategy``). What has no public form is
here, and nowhere else in weightlift: vLLM's layerwise reload and MTP check (the weight-transfer
engine's ``start``/``update``/``finish``), the tensor-parallel world size a rank loads in, and
the default loader's file preparation for a model that is neither a local folder nor in the
hub's cache (ModelScope). Each is called by keyword and was tested on the releases
:data:`TESTED` names. On another release :func:`tested` says so once, in one warning line, and
these parts turn off: the weight-transfer engine is not registered, a rank loads as under tensor
parallelism (nothing read whole ahead), and such a model is left to vLLM's default loader; the
load format itself keeps working.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["TESTED", "version", "within", "tested", "tp_size", "prepared_folder", "reload", "mtp_check_off"]

#: the vLLM releases (lowest, highest; both tested in CI on the CPU build) whose internals this
#: module was tested against
TESTED = ("0.29.0", "0.32.0")

_checked: bool | None = None


def version() -> str:
    """The installed vLLM's version string (``"0"`` where it does not say)."""
    import vllm

    return str(getattr(vllm, "__version__", "0"))


def _release(v: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``: the release numbers, without a local or dev suffix."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", v)
    return tuple(int(n) for n in m.group(1).split(".")) if m else (0,)


def within(v: str, lowest: str = TESTED[0], highest: str = TESTED[1]) -> bool:
    """Whether release ``v`` lies in ``lowest``..``highest`` (patch releases of ``highest``'s
    minor included: they fix, they do not move internals)."""
    r = _release(v)
    return _release(lowest) <= r and r[:2] <= _release(highest)[:2]


def tested() -> bool:
    """Whether the installed vLLM is one :data:`TESTED` covers; the first call outside the range
    logs one warning line saying what turns off."""
    global _checked
    if _checked is None:
        _checked = within(version())
        if not _checked:
            logging.getLogger("vllm.weightlift").warning(
                "weightlift: vLLM %s is outside the releases it was tested on (%s to %s): the "
                "weight-transfer engine is not registered and the load format uses vLLM's public "
                "interfaces only",
                version(),
                *TESTED,
            )
    return _checked


def tp_size() -> int | None:
    """The tensor-parallel world size this rank loads in (1 outside vLLM's distributed set-up);
    None where it cannot be asked (an untested vLLM)."""
    if not tested():
        return None
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return int(parallel_state.get_tensor_model_parallel_world_size())


def prepared_folder(loader: Any, model: str, revision: str | None) -> str | None:
    """The local folder vLLM's ``DefaultModelLoader`` (``loader``) prepares for ``model``
    (downloading it where it must), or None on an untested vLLM. Its ``_prepare_weights`` is
    private and its parameters have changed between releases: called by keyword, with only the
    ones this release takes."""
    if not tested():
        return None
    prepare = loader._prepare_weights
    params = inspect.signature(prepare).parameters
    kw: dict[str, Any] = {
        "model_name_or_path": model,
        "subfolder": None,
        "revision": revision,
        "fall_back_to_pt": True,
        "allow_patterns_overrides": None,
    }
    return str(prepare(**{k: v for k, v in kw.items() if k in params})[0])


def reload(model: Any, model_config: Any = None, *, start: bool) -> None:
    """vLLM's layerwise reload of ``model``: ``start`` saves each layer's processed tensors;
    else each layer is processed again (or put back where it got no weights)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    if start:
        initialize_layerwise_reload(model)
    else:
        finalize_layerwise_reload(model, model_config)


@contextlib.contextmanager
def mtp_check_off() -> Iterator[None]:
    """vLLM's multi-token-prediction completeness check off, for an update of some tensors."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with disable_mtp_completeness_check():
        yield
