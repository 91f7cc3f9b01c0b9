"""The ``check`` subcommand: parsing only; the checks are in :mod:`weightlift.check`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from weightlift.cli.remote import connection_args, link

__all__ = ["register"]


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are comma-separated integers, not {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds repeat in {text!r}")
    return seeds


def _cmd_check(a: argparse.Namespace) -> int:
    from weightlift.check import format_result, run_check

    token, tls = link(a)
    r = run_check(
        a.path,
        source=a.source,
        prompt=a.prompt,
        tokens=a.tokens,
        seeds=a.seeds,
        temperature=a.temperature,
        device=a.device,
        dtype=a.dtype,
        token=token,
        tls=tls,
        manifest=a.manifest,
    )
    print(json.dumps(r, indent=1, default=str) if a.json else format_result(r))
    return 0 if r["ok"] else 1


def register(sub: Any) -> None:
    """Add ``check`` to an argparse subparsers object."""
    c = sub.add_parser(
        "check", help="load a transformers model through weightlift and prove it runs exactly as transformers' own"
    )
    c.add_argument("path", help="the model folder as save_pretrained writes it (the reference is loaded from here)")
    c.add_argument(
        "--from", dest="source", metavar="HOST:PORT", help="build weightlift's model from what this tensor server holds"
    )
    connection_args(c)
    c.add_argument("--prompt", help="prompt text (token ids, comma-separated, without a tokenizer)")
    c.add_argument("--tokens", type=int, default=16, help="tokens to generate (default 16)")
    c.add_argument("--seeds", type=_seeds, default=(1, 2, 3), help="sampling seeds, comma-separated (default 1,2,3)")
    c.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    c.add_argument("--device", default="cpu", help="cpu or cuda[:N], for both models")
    c.add_argument("--dtype", help="load both in this dtype (default: the checkpoint's, as transformers' dtype='auto')")
    c.add_argument(
        "--manifest", metavar="FILE", help="the published manifest to check the digests against (default: beside PATH)"
    )
    c.add_argument("--json", action="store_true", help="print the comparison as JSON")
    c.set_defaults(func=_cmd_check)
