"""weightlift in vLLM: the ``weightlift`` load format and weight-transfer engine.

``pip install -e '.[vllm]'`` from a checkout (``'weightlift[vllm]'`` once published) installs
:func:`register` as a ``vllm.general_plugins`` entry point, which vLLM runs in each of its
processes before it builds a model; then
``LLM(model=..., load_format="weightlift")`` (``vllm serve --load-format weightlift``) loads
through :class:`~weightlift.integrations.vllm.loader.WeightliftModelLoader`, and
``weight_transfer_config={"backend": "weightlift"}`` gives the engine
:class:`~weightlift.integrations.vllm.engine.WeightliftWeightTransferEngine`. docs/vllm.md says
how each option maps.

This package imports vLLM only in :func:`register` and the modules it names, so that
``weightlift`` itself never needs it; every use of a vLLM internal is in :mod:`.compat`, with
the vLLM releases it was tested on.
"""

from __future__ import annotations

__all__ = ["register", "LOAD_FORMAT", "BACKEND"]

LOAD_FORMAT = "weightlift"
BACKEND = "weightlift"


_registered = False  # this process registered the load format already


def register() -> None:
    """Register the load format and, on a vLLM release :mod:`.compat` was tested on, the
    weight-transfer engine with vLLM (idempotent)."""
    global _registered
    from vllm.model_executor.model_loader import register_model_loader

    from weightlift.integrations.vllm import compat
    from weightlift.integrations.vllm.loader import WeightliftModelLoader

    # vLLM runs the plugin in each process, and a caller may have registered already (twice
    # is a warning in vLLM's log for a loader, an error for an engine)
    if not _registered:
        register_model_loader(LOAD_FORMAT)(WeightliftModelLoader)
        _registered = True
    if not compat.tested():
        return  # the engine needs vLLM's layerwise reload: not registered (said once)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "weightlift.integrations.vllm.engine", "WeightliftWeightTransferEngine"
        )
    except ValueError:
        pass  # registered already in this process
