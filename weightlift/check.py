"""``weightlift check``: does the model weightlift delivers run exactly as transformers' own?

Theory of operation
-------------------
The *reference* is transformers' own ``from_pretrained`` of the checkpoint folder (it reads the
files through ``safetensors``, not weightlift). The *subject* is the same model through
:mod:`weightlift.hf`: loaded from the folder by weightlift, or pulled from a tensor server that
holds the weights (``--from``). Then, in order:

1. tensors: every parameter and buffer of the subject is bit-identical to the reference's;
2. digests: against the published manifest named (``--manifest``) or lying beside the
   checkpoint (``weightlift manifest``'s output), the bytes the subject was built from match its BLAKE3. This is the only check that
   does not trust the file as it is now: a file corrupted on disk is read the same way by both
   loaders, so only a record published before the corruption can tell. weightlift's own cache
   of hashes is not such a record (it follows the file), so without a manifest nothing is checked;
3. logits on a fixed prompt are bit-identical;
4. greedy generation gives the same token ids (a BLAKE3 of them is printed);
5. sampling at a temperature, once per seed, each request with its own ``torch.Generator``
   seeded from its seed (never the process-wide generator): each seed run twice gives the same
   tokens, the reference gives them too, and different seeds give different tokens.

Encoder-only models (no ``generate``) stop after the logits. All checks pass: exit 0; any
fails: exit 1; a user mistake (no such folder, no transformers, a server that cannot be
reached): one line and exit 2, as for every command. The command's arguments are parsed in
:mod:`weightlift.cli.check`.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import OptionError

if TYPE_CHECKING:
    import ssl

__all__ = ["run_check", "generate", "ids_digest", "format_result", "CheckItem"]

DEFAULT_PROMPT = "The quick brown fox"
PROMPT_IDS = 8  # length of the fixed id prompt used without a tokenizer


@dataclass
class CheckItem:
    """One line of the verdict: ``ok`` is True, False, or None when the check could not apply."""

    name: str
    ok: bool | None
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def ids_digest(ids: list[int]) -> str:
    """BLAKE3 of token ids as little-endian int64, hex (the first 16 digits are printed)."""
    import blake3

    return blake3.blake3(b"".join(int(i).to_bytes(8, "little", signed=True) for i in ids)).hexdigest()


def generate(model: Any, prompt: list[int], n: int, *, temperature: float = 0.0, generator: Any = None) -> list[int]:
    """``n`` tokens after ``prompt``: greedy at temperature 0, else sampled with ``generator``.

    A plain loop over the model's forward with its KV cache, so the same code drives both
    models and the sampling draws only from the generator it is given.
    """
    import torch

    device = next(model.parameters()).device
    params = inspect.signature(model.forward).parameters
    # the KV cache argument was renamed within transformers 5 (past_key_values -> cache)
    kv = next((k for k in ("cache", "past_key_values") if k in params), None)
    ids = torch.tensor([prompt], device=device)
    out_ids: list[int] = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for i in range(n):
            logits = out.logits[0, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            else:
                nxt = logits.argmax(dim=-1, keepdim=True)
            out_ids.append(int(nxt.item()))
            if i + 1 == n:
                break
            past = out.get(kv) if kv is not None else None
            if kv is not None and past is not None:
                out = model(input_ids=nxt.view(1, 1), use_cache=True, **{kv: past})
            else:
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
                out = model(input_ids=ids)
    return out_ids


def _bits_equal(a: Any, b: Any) -> bool:
    """Bit-for-bit equality, NaN payloads included (``torch.equal`` calls NaN unequal to itself)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(flat(a), flat(b.to(a.device)))


def _named_tensors(model: Any) -> dict[str, Any]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return {k: v.detach() for k, v in out.items() if v is not None}


def _compare_tensors(subject: Any, reference: Any) -> CheckItem:
    a, b = _named_tensors(subject), _named_tensors(reference)
    only_s, only_r = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    differ = [n for n in sorted(set(a) & set(b)) if not _bits_equal(a[n], b[n])]
    data = {"compared": len(set(a) & set(b)), "differ": differ, "only_subject": only_s, "only_reference": only_r}
    if differ or only_s or only_r:
        parts = []
        if differ:
            parts.append(f"{len(differ)} differ from the reference ({_names(differ)})")
        if only_r:
            parts.append(f"{len(only_r)} missing ({_names(only_r)})")
        if only_s:
            parts.append(f"{len(only_s)} not in the reference ({_names(only_s)})")
        return CheckItem("tensors", False, "; ".join(parts), data)
    return CheckItem("tensors", True, f"{len(a)} parameters and buffers bit-identical to the reference", data)


def _names(names: list[str], k: int = 3) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


# -- digests ---------------------------------------------------------------------------------------


def _check_digests(ckpt: Any, delivered: Any, what: str, manifest: str | None) -> CheckItem:
    """The bytes of ``delivered`` (a Checkpoint: the files read, or what the server sent) against
    ``manifest``, else the one published beside ``ckpt`` (:func:`~weightlift.digest.published.reference`); the
    cache of hashes weightlift keeps is never taken for one."""
    from .api import load
    from .digest.blake import hash_buffer
    from .digest.published import reference
    from .errors import IntegrityError

    try:
        ref = reference(ckpt, ckpt.select(None), manifest)
    except IntegrityError as e:  # a published manifest that is damaged or lacks a tensor
        return CheckItem("digests", False, str(e), {"manifest": None})
    if ref.digests is None:
        return CheckItem(
            "digests",
            None,
            f"no published manifest (looked for {' and '.join(ref.tried)}): nothing published to compare with",
            {"manifest": None},
        )
    names = [t.name for t in delivered if t.name in ref.digests]
    views = load(delivered, copy=False, select=names, progress=False) if names else {}
    differ = [
        t.name for t in delivered if t.name not in ref.digests or hash_buffer(views[t.name]) != ref.digests[t.name]
    ]
    data = {"manifest": ref.manifest, "checked": len(names), "differ": differ}
    if differ:
        return CheckItem(
            "digests", False, f"{len(differ)} tensor(s) {what} differ from {ref.against}: {_names(differ)}", data
        )
    return CheckItem("digests", True, f"verified {len(names)} tensors {what} against {ref.against}", data)


# -- the check ----------------------------------------------------------------------------------------


def _prompt_ids(folder: str, config: Any, prompt: str | None) -> tuple[list[int], Any]:
    """Token ids of the prompt and the tokenizer (None without one beside the checkpoint)."""
    vocab = int(getattr(config.get_text_config(), "vocab_size", 0) or 0)
    has_tok = any(
        os.path.exists(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if has_tok:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            raise OptionError(
                f"{folder}: cannot read its tokenizer: {str(e).splitlines()[0] if str(e) else e}"
            ) from None
        ids = tok(prompt if prompt is not None else DEFAULT_PROMPT)["input_ids"]
        if not ids:
            raise OptionError("the prompt encodes to no tokens")
        return [int(i) for i in ids], tok
    if prompt is None:
        ids = [(1 + 7 * i) % max(vocab, 1) for i in range(PROMPT_IDS)]
    else:
        try:
            ids = [int(x) for x in prompt.replace(" ", "").split(",") if x]
        except ValueError:
            raise OptionError(
                f"no tokenizer beside {folder}: --prompt takes comma-separated token ids (e.g. 1,2,3)"
            ) from None
        if not ids:
            raise OptionError("--prompt holds no token ids")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise OptionError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids, None


def run_check(
    path: str,
    *,
    source: str | None = None,
    prompt: str | None = None,
    tokens: int = 16,
    seeds: tuple[int, ...] = (1, 2, 3),
    temperature: float = 1.0,
    device: str = "cpu",
    dtype: Any = None,
    token: bytes | str | None = None,
    tls: ssl.SSLContext | None = None,
    manifest: str | None = None,
) -> dict[str, Any]:
    """Run the checks of the module docstring; returns the verdict (``result["ok"]``) and every
    figure. ``manifest``: the published manifest the digests check compares with (default: the
    one beside the checkpoint). ``token`` and ``tls`` reach the server ``source`` (see
    :class:`~weightlift.remote.client.Client`)."""
    from . import hf

    hf.require_transformers()
    from transformers.utils import logging as hf_logging

    if tokens < 1:
        raise OptionError(f"--tokens must be at least 1, got {tokens}")
    if not temperature > 0:
        raise OptionError(f"--temperature must be above 0, got {temperature}")
    from .checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(ckpt.path))
    config = hf.load_config(folder)
    cls: Any = hf.model_class_for(config)
    dt = hf.resolve_dtype(dtype, config, ckpt)
    ids, tok = _prompt_ids(folder, config, prompt)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bars would bury the verdict
    items: list[CheckItem] = []
    result: dict[str, Any] = {
        "path": path,
        "source": source or "disk",
        "model_class": cls.__name__,
        "dtype": str(dt).replace("torch.", ""),
        "device": device,
        "prompt": ids,
    }
    try:
        with tempfile.TemporaryDirectory(prefix="weightlift-check-") as tmp:
            t0 = time.perf_counter()
            subject, info, delivered, what = _load_subject(
                path, folder, tmp, (source, token, tls), device, dt, cls, ckpt
            )
            result["subject_seconds"] = time.perf_counter() - t0
            result["loading_info"] = _jsonable_info(info)
            t0 = time.perf_counter()
            reference = _load_reference(cls, folder, dt, device)
            result["reference_seconds"] = time.perf_counter() - t0
            items.append(_compare_tensors(subject, reference))
            items.append(_check_digests(ckpt, delivered, what, manifest))
            items.extend(
                _run_model_checks(subject, reference, ids, tokens=tokens, seeds=seeds, temperature=temperature)
            )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    result["checks"] = [asdict(i) for i in items]
    result["ok"] = all(i.ok is not False for i in items)
    if tok is not None:
        for item in result["checks"]:
            if "tokens" in item["data"]:
                item["data"]["text"] = tok.decode(item["data"]["tokens"])
    return result


def _load_subject(
    path: str,
    folder: str,
    tmp: str,
    server: tuple[str | None, bytes | str | None, ssl.SSLContext | None],
    device: str,
    dt: Any,
    cls: Any,
    ckpt: Any,
) -> tuple[Any, dict[str, Any], Any, str]:
    """The model through weightlift: from the checkpoint, or pulled from ``source`` into ``tmp``;
    returns it, transformers' loading info, the checkpoint its bytes came from and where that is.
    ``server`` is the source's address (None: the checkpoint), token and TLS context."""
    from . import hf

    source, token, tls = server
    if source is None:
        subject, info = hf.from_pretrained(path, device=device, dtype=dt, model_class=cls, output_loading_info=True)
        return subject, info, ckpt, "read from the checkpoint"
    from .checkpoint import open_checkpoint
    from .remote.client import Client

    pulled = os.path.join(tmp, "model.safetensors")
    with Client(source, token=token, tls=tls) as c:
        if not c.pull(pulled):
            raise OptionError(f"the server at {source} holds no tensors")
    subject, info = hf.from_pretrained(
        pulled, config=folder, device=device, dtype=dt, model_class=cls, output_loading_info=True
    )
    return subject, info, open_checkpoint(pulled), f"held by {source}"


def _load_reference(cls: Any, folder: str, dt: Any, device: str) -> Any:
    """transformers' own load of the folder, on ``device``."""
    try:
        reference = cls.from_pretrained(folder, dtype=dt)
    except (OSError, ValueError) as e:
        raise OptionError(f"{folder}: transformers cannot load its reference model: {str(e).splitlines()[0]}") from None
    return reference if device == "cpu" else reference.to(device)


def _run_model_checks(
    subject: Any, reference: Any, ids: list[int], *, tokens: int, seeds: tuple[int, ...], temperature: float
) -> list[CheckItem]:
    import torch

    items = []
    x = torch.tensor([ids], device=next(subject.parameters()).device)
    with torch.inference_mode():
        a, b = subject(input_ids=x).logits, reference(input_ids=x).logits
    same = _bits_equal(a, b)
    diff = 0.0 if same else float((a.float() - b.float()).abs().max())
    items.append(
        CheckItem(
            "logits",
            same,
            f"{'bit-identical' if same else f'differ (max |diff| {diff:.3g})'} on a {len(ids)}-token prompt",
            {"max_abs_diff": diff},
        )
    )
    if not subject.can_generate():
        items.append(CheckItem("generation", None, f"{type(subject).__name__} does not generate: logits only"))
        return items
    g_s, g_r = generate(subject, ids, tokens), generate(reference, ids, tokens)
    items.append(
        CheckItem(
            "greedy",
            g_s == g_r,
            f"{tokens} tokens {'identical' if g_s == g_r else 'DIFFER from the reference'}  blake3:{ids_digest(g_s)[:16]}",
            {"tokens": g_s, "reference": g_r, "blake3": ids_digest(g_s)},
        )
    )
    gen_device = next(subject.parameters()).device

    def sample(model: Any, seed: int) -> list[int]:
        g = torch.Generator(device=gen_device)  # one per request: no state shared with other requests
        g.manual_seed(seed)
        return generate(model, ids, tokens, temperature=temperature, generator=g)

    outputs = {}
    for seed in seeds:
        first, again, ref = sample(subject, seed), sample(subject, seed), sample(reference, seed)
        ok = first == again == ref
        why = (
            "same tokens twice and as the reference"
            if ok
            else ("NOT reproduced by the same seed" if first != again else "differ from the reference's")
        )
        items.append(
            CheckItem(
                f"seed {seed}",
                ok,
                f"T={temperature:g}: {why}  blake3:{ids_digest(first)[:16]}",
                {"tokens": first, "again": again, "reference": ref, "blake3": ids_digest(first)},
            )
        )
        outputs[seed] = tuple(first)
    if len(seeds) > 1:
        distinct = len(set(outputs.values()))
        items.append(
            CheckItem(
                "seeds",
                distinct == len(outputs),
                f"{len(outputs)} seeds gave {distinct} different outputs",
                {"distinct": distinct},
            )
        )
    return items


def _jsonable_info(info: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in info.items():
        if isinstance(v, set):
            out[k] = sorted(str(x) for x in v)
        else:
            out[k] = v
    return out


def format_result(r: dict[str, Any]) -> str:
    """The verdict as the command prints it."""
    wl = r["loading_info"].get("weightlift", {})
    lines = [f"weightlift check {r['path']}: {r['model_class']}, {r['dtype']}, {r['device']}"]
    load = wl.get("pull") or wl.get("load") or {}
    src = f"server {r['source']}" if r["source"] != "disk" else "disk"
    lines.append(
        f"  subject    weightlift from {src}: {load.get('tensors', '?')} tensors, {load.get('bytes', 0):,} bytes;"
        f" {wl.get('shared', 0)} of {wl.get('parameters', 0)} parameters are the loaded tensors themselves"
        f" ({r['subject_seconds']:.2f} s)"
    )
    lines.append(f"  reference  transformers {r['model_class']}.from_pretrained ({r['reference_seconds']:.2f} s)")
    for k in ("missing_keys", "unexpected_keys"):
        if r["loading_info"].get(k):
            lines.append(f"  {k.replace('_', ' '):<10} {_names(r['loading_info'][k])}")
    for c in r["checks"]:
        mark = {True: "ok  ", False: "FAIL", None: "--  "}[c["ok"]]
        lines.append(f"  {mark} {c['name']:<10} {c['detail']}")
        if c["name"] == "greedy" and c["data"].get("text") is not None:
            lines.append(f"                  {c['data']['text']!r}")
    lines.append(
        "PASS: weightlift's model runs exactly as transformers' own"
        if r["ok"]
        else "FAIL: " + "; ".join(c["name"] for c in r["checks"] if c["ok"] is False)
    )
    return "\n".join(lines)
