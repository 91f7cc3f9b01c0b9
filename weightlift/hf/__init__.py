"""From weights to a running transformers model: weightlift reads the bytes, transformers wires them.

Theory of operation
-------------------
transformers' own ``from_pretrained`` builds the model on the meta device (no memory, no random
init), reads every checkpoint tensor, renames it (the base-model prefix, the model's conversion
mapping: legacy names, MoE experts merged into one tensor), casts it to its parameter's dtype and
sets it as the parameter; it then materialises what the checkpoint does not hold (non-persistent
buffers such as RoPE's ``inv_freq``, filled by the model's own ``_init_weights``), ties the tied
weights, reports missing and unexpected keys and sets the model to eval mode.

Here :func:`weightlift.load` does the reading, straight into the final device and dtype, and
the loaded tensors go through the same two transformers steps that map names and set
parameters (``convert_and_load_state_dict_in_model``) and that finish the model
(``_finalize_model_loading``), so the model is transformers' model bit for bit. A tensor that
already has its parameter's device and dtype passes through the first step as a view, and
``torch.nn.Parameter`` wraps it without a copy: the parameter *is* weightlift's tensor. The
loading info says which parameters are not (``info["weightlift"]["copied"]``): those a
conversion built from several tensors (stacked MoE experts) or had to cast. Both steps are
transformers internals of its v5 loader; a transformers without them is refused with one line
rather than loaded some other way.

Where the time goes, and so the order of the steps: compiling transformers' table of name
conversions (every model's, a thousand regular expressions) and building the model take most
of a warm load's Python time, and reading the bytes most of the rest. They do not depend on each
other, so the read starts first, on threads of its own, and the model is built meanwhile. On
the host, without a cast, nothing needs copying: the parameters view a private copy-on-write
mapping of the files, as transformers' own do, and those threads make the mapped bytes ready
to read (read in where cold, mapped, touched once: :func:`weightlift.memory.fresh.map_in`), so
that the first forward pass neither waits on storage nor faults page by page.

:func:`from_server` does the same with the tensors a :class:`weightlift.Server` holds (the model
then shares the server's memory, which the server never reuses while a tensor is referenced), or
with what a remote server holds, pulled over the wire.
"""

from __future__ import annotations

import copy as _copy
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from weightlift.api import run_load
from weightlift.checkpoint import Checkpoint, open_checkpoint
from weightlift.errors import NotFoundError, OptionError, WeightliftError, install_hint
from weightlift.hf.conversions import lazy_conversion_table
from weightlift.hf.mapped import read_and_map
from weightlift.hf.stored import model_folder
from weightlift.options import LoadOptions

__all__ = [
    "from_pretrained",
    "from_server",
    "from_state_dict",
    "model_class_for",
    "load_config",
    "resolve_dtype",
    "require_transformers",
]

#: The transformers releases whose loader this module drives (see the theory of operation).
TRANSFORMERS_MAJOR = 5


def require_transformers() -> Any:
    """The transformers module; OptionError naming the fix if it or its v5 loader is missing."""
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise OptionError(
            f"this needs transformers and torch ({e.name} is not installed): {install_hint('hf')}"
        ) from None
    major = int(transformers.__version__.split(".")[0])
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: F401
        from transformers.core_model_loading import convert_and_load_state_dict_in_model  # noqa: F401
        from transformers.modeling_utils import LoadStateDictConfig, PreTrainedModel  # noqa: F401
    except ImportError:
        major = -1
    if major != TRANSFORMERS_MAJOR or not hasattr(PreTrainedModel, "_finalize_model_loading"):
        raise OptionError(
            f"transformers {transformers.__version__} is not supported: weightlift.hf drives the loader of "
            f"transformers {TRANSFORMERS_MAJOR}.x ({install_hint('hf')})"
        )
    return transformers


# -- config, class, dtype ------------------------------------------------------------------------


def load_config(config: Any) -> Any:
    """A transformers config from a config object, a folder holding config.json, or a config.json path."""
    transformers = require_transformers()
    if isinstance(config, transformers.PretrainedConfig):
        return _copy.deepcopy(config)
    path = os.fspath(config)
    target = path if os.path.isdir(path) or path.endswith(".json") else os.path.dirname(path)
    if os.path.isdir(target) and not os.path.exists(os.path.join(target, "config.json")):
        raise NotFoundError("no config.json here (a folder written by save_pretrained has one)", file=target)
    if not os.path.exists(target):
        raise NotFoundError("no such file or folder", file=target)
    try:
        return transformers.AutoConfig.from_pretrained(target, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise OptionError(f"{target}: transformers cannot read this config: {_one_line(e)}") from None


def model_class_for(config: Any) -> type:
    """The model class a config names (``architectures``), else its causal-LM class, else its base model."""
    transformers = require_transformers()
    from transformers.models.auto import modeling_auto

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        try:
            return mapping[type(config)]
        except (KeyError, ValueError):
            continue
    raise OptionError(
        f"no transformers model class for model_type {getattr(config, 'model_type', '?')!r}; pass model_class"
    )


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None:
        return None
    found = dtype if isinstance(dtype, torch.dtype) else None
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        found = named if isinstance(named, torch.dtype) else None
        if found is None:
            from weightlift.dtypes import torch_dtype

            try:
                found = torch_dtype(dtype.upper())
            except (WeightliftError, KeyError):
                pass
    if found is None or not found.is_floating_point:
        raise OptionError(
            f"dtype {dtype!r} is not a floating-point torch dtype (e.g. torch.bfloat16, 'float16', 'F32')"
        )
    return found


def resolve_dtype(dtype: Any, config: Any, ckpt: Checkpoint | None, tensors: Mapping[str, Any] | None = None) -> Any:
    """transformers' ``dtype="auto"``: the config's dtype, else the first floating tensor's, else torch's default."""
    import torch

    if dtype is not None and dtype != "auto":
        return _torch_dtype(dtype)
    cfg = getattr(config, "dtype", None)
    if cfg is not None:
        return _torch_dtype(cfg)
    if ckpt is not None:
        for t in ckpt.tensors:
            if _file_dtype(t.dtype) is not None:
                return _file_dtype(t.dtype)
    for v in (tensors or {}).values():
        if getattr(v, "is_floating_point", lambda: False)():
            return v.dtype
    return torch.get_default_dtype()


# -- the model -------------------------------------------------------------------------------------


def _empty_model(cls: type, config: Any, dtype: Any) -> Any:
    """``cls(config)`` on the meta device under ``dtype``, in transformers' own init context."""
    from transformers.utils.generic import ContextManagers

    try:
        contexts = cls.get_init_context(dtype, False, False, None)  # type: ignore[attr-defined]
    except TypeError:  # releases before the kernels argument
        contexts = cls.get_init_context(dtype, False, False)  # type: ignore[attr-defined]
    with ContextManagers(contexts):
        model = cls(config)
    try:
        from transformers.monkey_patching import patch_output_recorders

        patch_output_recorders(model)
    except ImportError:
        pass
    return model


def _device(device: str) -> Any:
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise OptionError(f"device {device!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            from weightlift.errors import DeviceError

            raise DeviceError(f"device {device!r}: torch sees no CUDA device")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


def _file_dtype(name: str) -> Any:
    """The torch dtype of a floating-point checkpoint dtype name; None for other types."""
    from weightlift.dtypes import dtype_info, torch_dtype

    return torch_dtype(name) if name.startswith(("F", "BF")) and dtype_info(name).torch else None


def _uniform_dtype(model: Any) -> Any:
    """The one floating dtype of every parameter and persistent buffer, or None where they differ."""
    seen = {v.dtype for v in model.state_dict().values() if v.is_floating_point()}
    return seen.pop() if len(seen) == 1 else None


def from_state_dict(
    state_dict: Mapping[str, Any],
    config: Any,
    *,
    model_class: type | None = None,
    device: str = "cpu",
    dtype: Any = None,
    key_mapping: Mapping[str, str] | None = None,
    output_loading_info: bool = False,
    name_or_path: str | None = None,
) -> Any:
    """A transformers model whose parameters are the given tensors (checkpoint names, torch or numpy).

    Tensors already on ``device`` in their parameter's dtype become the parameters themselves;
    others are moved or cast once. ``dtype`` None follows transformers' ``dtype="auto"``.
    With ``output_loading_info`` returns ``(model, info)``, info as transformers reports it
    (missing, unexpected and mismatched keys, error messages) plus ``info["weightlift"]``.
    """
    require_transformers()
    config = load_config(config)
    cls = model_class or model_class_for(config)
    tensors = {k: _as_torch(v) for k, v in state_dict.items()}
    dt = resolve_dtype(dtype, config, None, tensors)
    model = _empty_model(cls, config, dt)
    plan = _load_plan(model, device=_device(device), dtype=dt, key_mapping=key_mapping, name_or_path=name_or_path)
    model, info = _assemble(model, tensors, plan, folder=None)
    return (model, info) if output_loading_info else model


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    dtype: Any = None,
    model_class: type | None = None,
    config: Any = None,
    key_mapping: Mapping[str, str] | None = None,
    output_loading_info: bool = False,
    copy: bool | None = None,
    **load_options: Any,
) -> Any:
    """The model of a checkpoint folder as ``save_pretrained`` writes it, loaded by weightlift.

    ``path`` is the folder (config.json beside ``model.safetensors`` or a shard index), or a
    .safetensors file or shard index in it; or the same in a store, by URL (``s3://bucket/prefix/``,
    ``https://host/path/``: see :mod:`weightlift.hf.stored`), whose weights then load as any URL
    load does, as copies. ``config`` overrides the folder's config (a config
    object, a folder or a config.json). ``dtype`` None is transformers' ``dtype="auto"``.
    ``model_class`` defaults to the config's ``architectures``. ``key_mapping`` is transformers'
    ``{regex: replacement}`` for checkpoint names. ``load_options`` go to :func:`weightlift.load`
    (``threads``, ``engine``, ``page_cache``, ``progress``, ``verify``...).

    ``copy`` says where the parameters' bytes live. None (the default) does what transformers'
    own loader does on the host when the files hold the parameters' dtype: the parameters view a
    private copy-on-write mapping of each file, so nothing is copied and a write to a parameter
    copies that page for this process alone. What weightlift adds happens while the model is
    being built: the mapped bytes are read in where cold, mapped and touched once, on parallel
    threads, so that the first forward pass finds them ready.
    Elsewhere (a device, a cast) None is ``copy=True``: tensors are read straight into
    ``device`` in their parameter's dtype, memory of their own, and become the parameters
    without a second copy. ``copy=False`` (host, no cast) makes them views of weightlift's
    read-only mapping: an in-place update of a parameter then crashes the process, so it is
    for inference only.
    """
    require_transformers()
    ckpt = open_checkpoint(path)
    if ckpt.format != "safetensors":
        raise OptionError(f"{ckpt.path}: weightlift.hf loads safetensors checkpoints, not {ckpt.format}")
    with model_folder(path, ckpt, config=config is None) as folder:  # a URL: its small files fetched
        config = load_config(config if config is not None else folder)
        cls = model_class or model_class_for(config)
        dt = resolve_dtype(dtype, config, ckpt)
        dev = _device(device)
        report: dict[str, Any] = {}
        # checked once, here, in the caller's thread; the read below may run on a thread of its own
        opts = LoadOptions(framework="torch", device=str(dev), report=report, **load_options)

        # Where the files already hold the model's dtype nothing is cast, whatever the model turns
        # out to be, so the read starts now, on threads of its own, and the model is built on the
        # meta device and its name conversions compiled (pure Python, most of transformers' own
        # load time) while it runs.
        uncast = all(_file_dtype(t.dtype) in (None, dt) for t in ckpt.tensors)
        mapped = copy is None and dev.type == "cpu" and uncast and ckpt.source is None  # a URL: no mapping
        early = None
        if mapped:
            early = _Background(read_and_map, ckpt, opts)
        elif copy is not False and uncast:
            early = _Background(run_load, ckpt, opts)
        try:
            model = _empty_model(cls, config, dt)
            plan = _load_plan(model, device=dev, dtype=dt, key_mapping=key_mapping, name_or_path=os.fspath(path))
        except BaseException:
            if early is not None:
                early.wait()
            raise
        if early is not None:
            sd = early.result()
        else:
            # one cast for all when every parameter shares a dtype; else file dtypes, cast per parameter below
            cast = _uniform_dtype(model)
            if cast is not None and all(_file_dtype(t.dtype) in (None, cast) for t in ckpt.tensors):
                cast = None  # nothing to cast: plain copies (or, with copy=False, views of the mapping)
            sd = run_load(ckpt, replace(opts, copy=copy is not False, dtype=cast))
        model, info = _assemble(model, sd, plan, folder=folder)
        info["weightlift"]["load"] = {
            k: report[k] for k in ("tensors", "bytes", "seconds", "verify", "manifest", "verified") if k in report
        }
        if "verify" in report:  # what a verify checked against: no one else sees this report
            from weightlift.digest.published import announce

            announce(report, logging.getLogger("weightlift.hf"))
        borrowed = copy is False and ckpt.source is None
        info["weightlift"]["storage"] = "private mapping" if mapped else "read-only mapping" if borrowed else "copies"
        return (model, info) if output_loading_info else model


class _Background:
    """``fn(*args)`` on a thread of its own; ``result()`` waits for it and returns or raises what it did."""

    def __init__(self, fn: Any, *args: Any) -> None:

        self._out: Any = None
        self._err: BaseException | None = None

        def run() -> None:
            try:
                self._out = fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                self._err = e

        self._thread = threading.Thread(target=run, name="wl-hf-load", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._err is not None:
            raise self._err
        return self._out


def from_server(
    server: Any,
    config: Any,
    *,
    device: str = "cpu",
    dtype: Any = None,
    model_class: type | None = None,
    key_mapping: Mapping[str, str] | None = None,
    output_loading_info: bool = False,
    token: str | bytes | None = None,
) -> Any:
    """The model whose weights a tensor server holds, under their checkpoint names.

    ``server`` is a :class:`weightlift.Server` in this process (its tensors become the parameters
    where device and dtype already match, shared, not copied) or the ``"host:port"`` of one
    elsewhere (its tensors are pulled into a temporary file and loaded from there). ``config`` is
    a config object, a folder holding config.json, or a config.json path.
    """
    require_transformers()
    if hasattr(server, "tensors") and callable(server.tensors):
        held = server.tensors(writable=True)  # they become the model's parameters, shared
        if not held:
            raise OptionError("the server holds no tensors")
        return from_state_dict(
            held,
            config,
            model_class=model_class,
            device=device,
            dtype=dtype,
            key_mapping=key_mapping,
            output_loading_info=output_loading_info,
        )
    from weightlift.remote.client import Client

    with tempfile.TemporaryDirectory(prefix="weightlift-pull-") as tmp:
        pulled = os.path.join(tmp, "model.safetensors")
        t0 = time.perf_counter()
        with Client(server, token=token) as c:
            entries = c.pull(pulled)
        if not entries:
            raise OptionError(f"the server at {server} holds no tensors")
        seconds = time.perf_counter() - t0
        out = from_pretrained(
            pulled,
            config=config,
            device=device,
            dtype=dtype,
            model_class=model_class,
            key_mapping=key_mapping,
            output_loading_info=True,
            copy=True,  # owned memory: the pulled file goes with its folder
        )
    model, info = out
    info["weightlift"]["pull"] = {"tensors": len(entries), "bytes": sum(e.nbytes for e in entries), "seconds": seconds}
    return (model, info) if output_loading_info else model


def _as_torch(x: Any) -> Any:
    """A torch tensor sharing ``x``'s memory (numpy arrays of any dtype, bfloat16 included)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    from weightlift.dtypes import from_numpy
    from weightlift.memory.targets import as_bytes, view_as

    return view_as(as_bytes(x), from_numpy(x.dtype), tuple(x.shape), "torch")


def _load_plan(model: Any, *, device: Any, dtype: Any, key_mapping: Any, name_or_path: str | None) -> Any:
    """transformers' load settings for ``model``: its device, dtype plan and name conversions.

    The conversions are compiled from transformers' table of every model's renamings, the
    costliest step of its loader before any tensor is read; it needs the model, not the tensors.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig

    lazy_conversion_table()
    return LoadStateDictConfig(
        pretrained_model_name_or_path=name_or_path,
        device_map={"": device},
        dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype),
        weight_mapping=get_model_conversion_mapping(model, key_mapping, None),
    )


def _assemble(
    model: Any, tensors: Mapping[str, Any], load_config_: Any, *, folder: str | None
) -> tuple[Any, dict[str, Any]]:
    """Set the tensors as the model's parameters and finish it, through transformers' own loader steps."""
    import torch
    from transformers.core_model_loading import convert_and_load_state_dict_in_model

    name_or_path = load_config_.pretrained_model_name_or_path
    dtype = load_config_.dtype
    try:
        loading, _ = convert_and_load_state_dict_in_model(
            model=model, state_dict=dict(tensors), load_config=load_config_
        )
        loading = type(model)._finalize_model_loading(model, load_config_, loading)
    except (RuntimeError, ValueError, KeyError, AttributeError) as e:
        raise OptionError(
            f"{name_or_path or 'state dict'}: transformers cannot assemble {type(model).__name__} from these tensors: {_one_line(e)}"
        ) from None
    model.config.dtype = dtype
    if name_or_path is not None:
        model.config.name_or_path = name_or_path
    model.eval()
    if folder is not None:
        _generation_config(model, folder)
    info = loading.to_dict()
    info["conversion_errors"] = dict(getattr(loading, "conversion_errors", {}) or {})
    # the parameters that are weightlift's tensors themselves, and those a conversion or cast made anew
    loaded = {(t.data_ptr(), t.dtype, t.device) for t in tensors.values() if isinstance(t, torch.Tensor) and t.numel()}
    shared, copied = 0, []
    for name, p in model.named_parameters():
        if p.numel() == 0 or p.device.type == "meta":
            continue
        if (p.data_ptr(), p.dtype, p.device) in loaded:
            shared += 1
        else:
            copied.append(name)
    info["weightlift"] = {"parameters": shared + len(copied), "shared": shared, "copied": copied}
    return model, info


def _generation_config(model: Any, folder: str) -> None:
    """The folder's generation_config.json, as transformers' from_pretrained reads it."""
    if not (model.can_generate() and os.path.exists(os.path.join(folder, "generation_config.json"))):
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise OptionError(f"{folder}: generation_config.json: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
