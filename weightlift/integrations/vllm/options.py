"""The options of the ``weightlift`` load format, as vLLM's ``model_loader_extra_config`` gives them.

vLLM hands a load format one JSON object (``--model-loader-extra-config``); this module checks it
once, without importing vLLM or torch, and says in one line what is wrong with a key or a value,
so that a typo stops the engine at its start instead of being ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightlift.errors import OptionError
from weightlift.options import PAGE_CACHE
from weightlift.remote.client.connection import MAX_TIMEOUT
from weightlift.remote.token import read_token

__all__ = ["LoaderOptions", "KEYS"]

#: The keys the load format takes, and what each is for (named in the error for an unknown key).
KEYS = {
    "verify": "check every tensor as it lands against the manifest, else the one published beside the "
    "checkpoint, else (said so in the log) only the files as they are now",
    "manifest": "the published manifest to verify against (a path; default: the one beside the checkpoint)",
    "prefetch": "read a cold checkpoint into the page cache while vLLM builds the model (default: where "
    "vLLM's safetensors_load_strategy is 'prefetch')",
    "page_cache": "'keep' or 'evict' the page cache after the load",
    "prefault": "removed (it did not shorten the time to first token); false is still taken",
    "threads": "readers for a cold checkpoint",
    "copy": "read into fresh memory instead of handing out views of the file's mapping",
    "server": "take the tensors from a weightlift tensor server ('host:port') instead of the files",
    "token_file": "a file holding the server's token",
    "tls": "speak TLS to the server: true (the system's roots) or a CA file",
    "timeout": "seconds a reply from the server may take",
}


@dataclass(frozen=True)
class LoaderOptions:
    """The checked ``model_loader_extra_config`` of the ``weightlift`` load format."""

    verify: bool = False
    manifest: str | None = None
    prefetch: bool | None = None
    prefault: bool | None = None
    page_cache: str | None = None
    threads: int | None = None
    copy: bool = False
    server: str | None = None
    token_file: str | None = None
    tls: bool | str = False
    timeout: float = 60.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> LoaderOptions:
        """Check ``extra`` (vLLM's dict); OptionError naming the first key or value that is wrong."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            known = "; ".join(f"{k}: {v}" for k, v in KEYS.items())
            raise OptionError(f"load format 'weightlift' has no option {unknown[0]!r} (it takes {known})")
        for key in ("verify", "prefetch", "prefault", "copy"):
            if not isinstance(extra.get(key, False), bool) and not (
                key in ("prefetch", "prefault") and extra[key] is None
            ):
                raise OptionError(f"load format 'weightlift': {key} must be true or false, not {extra[key]!r}")
        threads = extra.get("threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise OptionError(f"load format 'weightlift': threads must be a positive integer, not {threads!r}")
        if extra.get("page_cache") not in PAGE_CACHE:
            raise OptionError(
                f"load format 'weightlift': page_cache must be 'keep' or 'evict', not {extra['page_cache']!r}"
            )
        for key in ("manifest", "server", "token_file"):
            if extra.get(key) is not None and not isinstance(extra[key], str | os.PathLike):
                raise OptionError(f"load format 'weightlift': {key} must be a string, not {extra[key]!r}")
        tls = extra.get("tls", False)
        if not isinstance(tls, bool | str):
            raise OptionError(f"load format 'weightlift': tls must be true, false or a CA file, not {tls!r}")
        opts = cls(**{k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in extra.items()})
        if opts.server is None and (opts.token_file is not None or opts.tls):
            raise OptionError("load format 'weightlift': token_file and tls are for a server; set server too")
        if opts.prefault:
            raise OptionError(
                "load format 'weightlift': prefault was removed (it did not shorten the time to first token); "
                "leave it out"
            )
        if opts.server is not None and (opts.manifest is not None or True in (opts.prefetch, opts.copy)):
            raise OptionError(
                "load format 'weightlift': manifest, prefetch and copy are for the files; "
                "with server, verify checks the digests the server states"
            )
        if opts.manifest is not None and not opts.verify:
            raise OptionError("load format 'weightlift': manifest is what verify checks against; set verify too")
        t = opts.timeout
        # vLLM's JSON takes Infinity and NaN: both fail the range (NaN every comparison)
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= MAX_TIMEOUT:
            raise OptionError(
                f"load format 'weightlift': timeout must be a positive number of seconds up to {MAX_TIMEOUT:.0f}, not {t!r}"
            )
        return opts

    def reads_ahead(self, strategy: str | None = None) -> bool:
        """Whether the files are read into the page cache while vLLM builds the model: as
        ``prefetch`` says, else where vLLM's ``safetensors_load_strategy`` (``strategy``) is
        ``"prefetch"``, the tensors come from files and the page cache is kept (with
        ``page_cache: "evict"`` it competes with the destination)."""
        if self.prefetch is not None:
            return self.prefetch
        return strategy == "prefetch" and self.server is None and self.page_cache != "evict"

    def token(self) -> bytes | None:
        """The server's token, read from ``token_file`` as the CLI's ``--token-file`` is: a file only
        its owner may read, holding at least 16 bytes (surrounding whitespace dropped)."""
        return read_token(self.token_file)
