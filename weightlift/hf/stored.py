"""A model folder in an object store or behind HTTP, as :func:`weightlift.hf.from_pretrained` reads it.

transformers reads a folder's small files itself (``config.json``, ``generation_config.json``)
and weightlift the weights. For a URL the weights come through the store's ranged-read engine
like any URL load; the small files are read whole from beside the checkpoint into a temporary
folder that lives for the call, so transformers reads them with its own parsers, offline, as
it reads a local folder. Nothing else of the folder is fetched: the weights are never on local
disk.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from weightlift.checkpoint import Checkpoint
from weightlift.errors import NotFoundError

__all__ = ["model_folder", "SMALL_FILES", "MAX_SMALL_FILE"]

#: the folder's files transformers reads besides the weights: the config (required unless one
#: is given) and the generation config (where the folder has one)
SMALL_FILES = ("config.json", "generation_config.json")
#: the largest small file read from a store
MAX_SMALL_FILE = 16 * 1024 * 1024


@contextlib.contextmanager
def model_folder(path: str | os.PathLike[str], ckpt: Checkpoint, *, config: bool = True) -> Iterator[str]:
    """The local folder whose small files describe ``ckpt``: the checkpoint's own folder for a
    local path; for a URL a temporary folder holding the small files found beside the
    checkpoint in the store (``config`` False: the config is given, not fetched)."""
    if ckpt.source is None:
        p = os.fspath(path)
        yield p if os.path.isdir(p) else os.path.dirname(os.path.abspath(ckpt.path))
        return
    src = ckpt.source
    with tempfile.TemporaryDirectory(prefix="weightlift-hf-") as tmp:
        for name in SMALL_FILES if config else SMALL_FILES[1:]:
            url = src.sibling(ckpt.path, name)
            if not src.exists(url):
                if name == "config.json":
                    raise NotFoundError(
                        "no config.json beside the checkpoint (a folder written by save_pretrained has one; "
                        "or pass config=)",
                        file=url,
                    )
                continue
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(src.read_all(url, MAX_SMALL_FILE))
        yield tmp
