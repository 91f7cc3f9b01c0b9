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
import errno
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from weightlift.checkpoint import Checkpoint
from weightlift.errors import FileError, NotFoundError

__all__ = ["model_folder", "SMALL_FILES", "MAX_SMALL_FILE"]

#: the folder's files transformers reads besides the weights: the config (required unless one
#: is given) and the generation config (where the folder has one)
SMALL_FILES = ("config.json", "generation_config.json")
#: the largest small file read from a store
MAX_SMALL_FILE = 16 * 1024 * 1024

_log = logging.getLogger("weightlift.hf")


def _present(src: Any, url: str, required: bool) -> bool:
    """Whether the small file ``url`` is in the store. S3 answers a caller who may not list the
    bucket 403, not 404, for a key that does not exist: for an optional file that is taken as
    absent; for a required one it stays the error, naming the object."""
    try:
        return bool(src.exists(url))
    except FileError as e:
        if required or e.errno != errno.EACCES:
            raise
        _log.debug("%s: access denied, taken as absent (a store that may not be listed says so for a missing key)", url)
        return False


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
            if not _present(src, url, required=name == "config.json"):
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
