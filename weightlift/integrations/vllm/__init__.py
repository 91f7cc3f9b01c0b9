"""weightlift in vLLM: the ``weightlift`` load format and weight-transfer engine.

``pip install 'weightlift[vllm]'`` installs :func:`register` as a ``vllm.general_plugins`` entry
point, which vLLM runs in each of its processes before it builds a model; then
``LLM(model=..., load_format="weightlift")`` (``vllm serve --load-format weightlift``) loads
through :class:`~weightlift.integrations.vllm.loader.WeightliftModelLoader`, and
``weight_transfer_config={"backend": "weightlift"}`` gives the engine
:class:`~weightlift.integrations.vllm.engine.WeightliftWeightTransferEngine`. docs/vllm.md says
how each option maps.

This package imports vLLM only in :func:`register` and the modules it names, so that
``weightlift`` itself never needs it.
"""

from __future__ import annotations

__all__ = ["register", "LOAD_FORMAT", "BACKEND"]

LOAD_FORMAT = "weightlift"
BACKEND = "weightlift"


def register() -> None:
    """Register the load format and the weight-transfer engine with vLLM (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor import model_loader

    from weightlift.integrations.vllm import early, prefault
    from weightlift.integrations.vllm.loader import WeightliftModelLoader

    # vLLM runs the plugin in each process, and a caller may have registered already: its
    # registries are asked first (registering twice is a warning for a loader, an error for an
    # engine)
    if getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).get(LOAD_FORMAT) is not WeightliftModelLoader:
        model_loader.register_model_loader(LOAD_FORMAT)(WeightliftModelLoader)
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "weightlift.integrations.vllm.engine", "WeightliftWeightTransferEngine"
        )
    early.install()  # a cold checkpoint read from the moment the engine's configuration exists
    prefault.from_environment()  # in the process spawned to build the model: its memory, faulted in ahead
