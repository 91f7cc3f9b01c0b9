"""Opening a checkpoint: a path becomes a list of tensor descriptions, without reading data.

A path is a ``.safetensors`` file, a shard index (``*.safetensors.index.json`` as transformers
writes it, with a ``weight_map``), a ``.gguf`` file, or a folder holding one of those. Headers
are read and validated here (through the pure parsers in :mod:`weightlift.formats`); tensor
bytes are not touched until a load asks for them.

A folder is resolved as transformers' ``from_pretrained`` resolves it, so both load the same
weights: ``model.safetensors`` if present (even beside an index), else
``model.safetensors.index.json``, else the one ``*.safetensors.index.json``, else the one
``.safetensors`` file, else the one ``.gguf`` file or split GGUF set. Several candidates of the
kind that decides (two indexes, two ``.safetensors`` files without an index, two ``.gguf`` files
that are not one split set) are refused with their names: picking one would be a guess.

A split GGUF model (gguf-split's ``<prefix>-00001-of-0000N.gguf`` and on) opens as one
checkpoint from its first file, or from the folder holding it, as llama.cpp loads it: the
first file names the count, the others are found by name, and each must say it is that split
of that count, no tensor may repeat, and together they must hold ``split.tensors.count``
tensors (a FormatError or NotFoundError naming the file otherwise). Naming a later split is
refused with the first split's name, as llama.cpp refuses it. A file named as a split of several whose
metadata names no split count is refused too: alone it would load as part of a model.

A URL (``s3://bucket/prefix/...``, ``http(s)://...``) opens the same way from an object store
or a web server (:mod:`weightlift.sources`): headers by small ranged reads, a prefix resolved as
a folder is (an HTTP server, which cannot be listed, by the names in :data:`PREFERRED`), and the
checkpoint's ``source`` keeps the objects' identities for the load.

A shard index follows transformers where transformers loads weights, and is refused (a
FormatError naming the index and the key) where transformers fails or where the weights would
depend on the order of files:

- it must be UTF-8 JSON without a byte-order mark (transformers reads it as strict UTF-8, and
  ``json`` refuses a mark), an object with a non-empty ``weight_map`` object whose values are
  file names beside the index, and a ``metadata`` object (transformers requires both);
- the shards are the distinct files the ``weight_map`` names, in sorted order, and the
  checkpoint holds every tensor of their headers, also one the ``weight_map`` omits
  (transformers loads every key of every listed shard);
- a tensor in two listed shards is refused (transformers silently takes the last shard's copy);
- a ``weight_map`` entry whose shard lacks the tensor is refused (the index is wrong about it).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightlift.errors import FormatError, NotFoundError, OptionError, os_error
from weightlift.formats import TensorInfo
from weightlift.formats import safetensors as st
from weightlift.options import Select
from weightlift.sources.url import is_url

if TYPE_CHECKING:
    from weightlift.disk.source import MappedFile
    from weightlift.sources.objects import Objects

__all__ = ["Checkpoint", "open_checkpoint", "Select", "MAX_INDEX_SIZE", "PREFERRED"]

MAX_INDEX_SIZE = 64 * 1024 * 1024


@dataclass
class Checkpoint:
    """The tensors of a checkpoint (file order, file by file), its files and its metadata."""

    path: str
    format: str
    files: list[str]
    tensors: list[TensorInfo]
    metadata: dict[str, Any] = field(default_factory=dict)
    # (st_dev, st_ino, size, mtime_ns) of each file when its header was read: a loader checks
    # its mapping against this, so a file replaced since then cannot mix old offsets and new bytes
    identity: dict[str, tuple[int, int, int, int]] = field(default_factory=dict, repr=False)
    _by_name: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    #: for a checkpoint opened from a URL, its objects in the store (their ETags, the clients)
    source: Objects | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self._by_name:
            self._by_name = {t.name: t for t in self.tensors}

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise NotFoundError("no such tensor", file=self.path, tensor=name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def mapped(self, file: str, *, own: bool = False) -> MappedFile:
        """``file``'s one mapping, refused (FormatError) if the file is no longer the one whose header was parsed.
        ``own``: a mapping apart from the process's one, gone with its last reference."""
        from weightlift.disk.source import MappedFile, mapped

        if self.source is not None:
            raise OptionError(f"{file} is in a store: it has no local mapping")
        m = MappedFile(file) if own else mapped(file)
        seen = self.identity.get(file)
        i = m.identity
        if seen is not None and seen != (i.dev, i.ino, i.size, i.mtime_ns):
            raise FormatError("changed on disk since its header was read; open it again", file=file)
        return m

    @property
    def nbytes(self) -> int:
        return sum(t.length for t in self.tensors)

    def select(self, select: Select = None) -> list[TensorInfo]:
        """Tensors whose name matches ``select``: None (all), a glob, a compiled regex, or globs.

        A ``set``/``frozenset`` holds exact names. A string starting with ``re:`` is a regex (``re:layers\\.[0-3]\\.``). A selection that
        matches nothing is an error, since it is almost always a typo.
        """
        if select is None:
            return list(self.tensors)
        match = matcher(select)
        chosen = [t for t in self.tensors if match(t.name)]
        if not chosen:
            raise NotFoundError(f"selection {_describe(select)} matches no tensor", file=self.path)
        return chosen


def matcher(select: Select) -> Any:
    """A predicate on names: globs match the whole name, regexes (``re:``) search within it."""
    if isinstance(select, re.Pattern):
        rx = select
        return lambda n: rx.search(n) is not None
    if isinstance(select, (set, frozenset)):
        exact = frozenset(select)
        return lambda n: n in exact
    if isinstance(select, str):
        select = [select]
    if not isinstance(select, (list, tuple)):
        raise OptionError(
            f"select: expected a glob, a list of globs, a set of names or a compiled regex, got {select!r}"
        )
    tests = []
    for s in select:
        if not isinstance(s, str):
            raise OptionError(f"select: expected glob strings or a regex, got {s!r}")
        if s.startswith("re:"):
            try:
                tests.append(re.compile(s[3:]).search)
            except re.error as e:
                raise OptionError(f"select: bad regex {s[3:]!r}: {e}") from None
        else:
            tests.append(re.compile(fnmatch.translate(s)).match)
    return lambda n: any(t(n) is not None for t in tests)


def _describe(select: Select) -> str:
    if isinstance(select, re.Pattern):
        return f"re:{select.pattern}"
    if isinstance(select, str):
        return repr(select)
    if isinstance(select, (set, frozenset)):
        return f"{len(select)} exact names"
    return ", ".join(repr(s) for s in select)  # type: ignore[union-attr]


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open ``path`` and parse every header it involves; no tensor data is read."""
    p = os.fspath(path)
    if is_url(p):
        return _open_url(p)
    if not os.path.exists(p):
        raise NotFoundError("no such file or folder", file=p)
    if os.path.isdir(p):
        p = _pick_in_folder(p)
    if not os.path.isfile(p):
        raise FormatError("not a regular file", file=p)
    if p.endswith(".json"):
        return _open_index(p)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise os_error(e, p, "cannot read") from None
    if magic == b"GGUF" or p.lower().endswith(".gguf"):
        # a .gguf file with a bad magic is a broken GGUF file, not a safetensors one
        return _open_gguf(p)
    tensors, meta, ident = _read_safetensors(p)
    return Checkpoint(p, "safetensors", [p], tensors, dict(meta), {p: ident})


#: What transformers prefers in a folder, in its order.
PREFERRED = ("model.safetensors", "model.safetensors.index.json")
_BOMS = (b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")


def _one(d: str, names: list[str], what: str) -> str | None:
    if len(names) > 1:
        raise FormatError(f"several {what} ({', '.join(names)}); name one", file=d)
    return names[0] if names else None


def _pick_in_folder(d: str) -> str:
    names = sorted(os.listdir(d))
    for n in PREFERRED:
        if n in names and os.path.isfile(os.path.join(d, n)):
            return os.path.join(d, n)
    return _pick(d, names, os.path.join)


def _pick(d: str, names: list[str], join: Any) -> str:
    """The checkpoint among ``names`` in folder (or prefix) ``d``, after PREFERRED."""
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    st_files = [n for n in names if n.endswith(".safetensors")]
    ggufs = _first_split(d, [n for n in names if n.lower().endswith(".gguf")])
    found = (
        _one(d, indexes, "shard indexes")
        or _one(d, st_files, ".safetensors files and no index")
        or _one(d, ggufs, ".gguf files")
    )
    if found is None:
        raise NotFoundError("holds no .safetensors, shard index or .gguf file", file=d)
    return str(join(d, found))


def _first_split(d: str, names: list[str]) -> list[str]:
    """``names``, or the first split's alone where they are all splits of one set."""
    if len(names) < 2:
        return names
    from weightlift.formats import gguf  # the gguf package is slow to import: only for GGUF

    parts = [gguf.split_parts(n) for n in names]
    sets = {(p[0], p[2]) for p in parts if p is not None}
    if None in parts or len(sets) != 1:
        return names
    ((prefix, count),) = sets
    first = gguf.split_name(prefix, 0, count)
    if first not in names:
        raise NotFoundError(f"holds splits of a GGUF model but not its first split, {first}", file=d)
    return [first]


def _read_safetensors(path: str) -> tuple[list[TensorInfo], dict[str, str], tuple[int, int, int, int]]:
    try:
        with open(path, "rb") as f:
            st_ = os.fstat(f.fileno())
            size = st_.st_size
            prefix = f.read(st.PREFIX_SIZE)
            n = st.header_length(prefix, file=path, file_size=size)
            header = f.read(n)
    except OSError as e:
        raise os_error(e, path, "cannot read") from None
    if len(header) != n:
        raise FormatError("file shrank while its header was read", file=path)
    tensors, meta = st.parse_header(header, file=path, file_size=size)
    return tensors, meta, (st_.st_dev, st_.st_ino, size, st_.st_mtime_ns)


def _open_gguf(path: str) -> Checkpoint:
    from weightlift.disk.source import mapped
    from weightlift.formats import gguf

    identity: dict[str, tuple[int, int, int, int]] = {}

    def header(p: str) -> tuple[list[TensorInfo], dict[str, Any]]:
        m = mapped(p)
        head = gguf.parse_gguf(m.buffer, file=p, file_size=m.size)
        i = m.identity
        identity[p] = (i.dev, i.ino, i.size, i.mtime_ns)
        return list(head.tensors), dict(head.metadata)

    def beside(p: str, name: str) -> str:
        return os.path.join(os.path.dirname(p), name)

    files, tensors, meta = _gguf_set(path, os.path.basename(path), header, os.path.isfile, beside)
    return Checkpoint(path, "gguf", files, tensors, meta, identity)


_Header = Callable[[str], tuple[list[TensorInfo], dict[str, Any]]]


def _gguf_set(
    path: str, name: str, header: _Header, exists: Callable[[str], bool], sibling: Callable[[str, str], str]
) -> tuple[list[str], list[TensorInfo], dict[str, Any]]:
    """The files, tensors and metadata of the GGUF model at ``path``: its one file, or every
    split of a split model (see the module docstring), the metadata being the first split's.
    ``name``: the file's name as ``sibling`` takes names (a URL's is decoded, not its last part)."""
    from weightlift.formats import gguf

    tensors, meta = header(path)
    first = gguf.split_of(meta, file=path)
    parts = gguf.split_parts(name)
    if first is None:
        if parts is not None and parts[2] > 1:  # loaded alone it would be part of a model, silently
            raise FormatError(
                f"is named as split {parts[1] + 1} of {parts[2]} of a GGUF model, but its metadata has no "
                f"{gguf.SPLIT_COUNT} over 1: it is not known which files make the model (rename it if it "
                "is a whole model)",
                file=path,
            )
        return [path], tensors, meta
    count = first.count
    prefix = parts[0] if parts is not None and parts[1:] == (first.no, count) else None
    if first.no != 0:
        hint = f" (here {gguf.split_name(prefix, 0, count)})" if prefix is not None else ""
        msg = f"is split {first.no + 1} of {count} of a GGUF model; open its first split{hint}, which names them all"
        raise FormatError(msg, file=path)
    if prefix is None:
        expected = f"<prefix>-00001-of-{count:05d}.gguf"
        raise FormatError(
            f"is the first of {count} GGUF splits, but not named {expected}: its others cannot be found", file=path
        )
    files, out = [path], list(tensors)
    found = {t.name: name for t in tensors}
    for no in range(1, count):
        sname = gguf.split_name(prefix, no, count)
        sp = sibling(path, sname)
        if not exists(sp):
            raise NotFoundError(f"split {no + 1} of {count}, {sname}, does not exist", file=path)
        infos, smeta = header(sp)
        if smeta.get(gguf.SPLIT_COUNT) != count:
            got = smeta.get(gguf.SPLIT_COUNT, "missing")
            raise FormatError(f"{gguf.SPLIT_COUNT} is {got}, but {name} says {count}", file=sp)
        split = gguf.split_of(smeta, file=sp)
        assert split is not None  # its count is the first's, over 1
        if split.no != no:
            raise FormatError(f"{gguf.SPLIT_NO} is {split.no}, but its name makes it split {no} (from 0)", file=sp)
        if split.tensors != first.tensors:
            msg = f"{gguf.SPLIT_TENSORS} is {split.tensors}, but {name} says {first.tensors}"
            raise FormatError(msg, file=sp)
        for t in infos:
            if t.name in found:
                raise FormatError(f"tensor is in two splits, {found[t.name]} and {sname}", file=sp, tensor=t.name)
            found[t.name] = sname
        files.append(sp)
        out.extend(infos)
    if len(out) != first.tensors:
        msg = f"{gguf.SPLIT_TENSORS} is {first.tensors}, but its {count} splits hold {len(out)} tensors"
        raise FormatError(msg, file=path)
    return files, out, meta


def _read_index(path: str) -> dict[str, Any]:
    """The index's JSON object, with its ``weight_map`` and ``metadata`` checked as the module
    docstring says."""
    try:
        size = os.path.getsize(path)
        if size > MAX_INDEX_SIZE:
            raise FormatError(f"index is {size} bytes, over the limit of {MAX_INDEX_SIZE}", file=path)
        with open(path, "rb") as f:
            raw = f.read(MAX_INDEX_SIZE + 1)
    except OSError as e:
        raise os_error(e, path, "cannot read") from None
    return _parse_index(raw, path)


def _parse_index(raw: bytes, path: str) -> dict[str, Any]:
    """The index's bytes (from a file or a store) as its checked JSON object."""
    if raw.startswith(_BOMS):
        raise FormatError("index starts with a byte-order mark; it must be UTF-8 without one", file=path)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise FormatError(f"index is not UTF-8: {e}", file=path) from None
    except (ValueError, RecursionError) as e:
        raise FormatError(f"index is not valid JSON: {type(e).__name__}: {e}", file=path) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise FormatError("index has no weight_map object", file=path)
    if not obj["weight_map"]:
        raise FormatError("index's weight_map is empty", file=path)
    for name, shard in obj["weight_map"].items():
        if not isinstance(shard, str) or not shard or os.path.isabs(shard) or ".." in shard.split("/"):
            raise FormatError(f"weight_map names shard {shard!r}, not a file beside the index", file=path, tensor=name)
    if not isinstance(obj.get("metadata"), dict):
        what = "no metadata" if "metadata" not in obj else f"metadata that is {type(obj['metadata']).__name__}"
        raise FormatError(f"index has {what}, not an object", file=path)
    return obj


def _open_index(path: str, source: Objects | None = None) -> Checkpoint:
    obj = _read_index(path) if source is None else _parse_index(source.read_all(path, MAX_INDEX_SIZE), path)
    weight_map: dict[str, str] = obj["weight_map"]
    base = os.path.dirname(os.path.abspath(path)) if source is None else ""
    files: list[str] = []
    tensors: list[TensorInfo] = []
    identity: dict[str, tuple[int, int, int, int]] = {}
    found: dict[str, str] = {}  # tensor -> the shard holding it
    for shard in sorted(set(weight_map.values())):
        sp = os.path.join(base, shard) if source is None else source.sibling(path, shard)
        if not (os.path.exists(sp) if source is None else source.exists(sp)):
            raise NotFoundError(f"shard {shard!r} named by the index does not exist", file=path)
        if source is None:
            infos, _, identity[sp] = _read_safetensors(sp)
        else:
            infos, _ = source.safetensors_header(sp)
        for t in infos:
            if t.name in found:
                raise FormatError(
                    f"tensor is in two shards, {found[t.name]!r} and {shard!r}; which copy is meant is ambiguous",
                    file=path,
                    tensor=t.name,
                )
            found[t.name] = shard
        files.append(sp)
        tensors.extend(infos)
    for name, shard in weight_map.items():
        if name in found and found[name] != shard:
            raise FormatError(
                f"index places this tensor in {shard!r}; it is in {found[name]!r}", file=path, tensor=name
            )
        if name not in found:
            raise FormatError(f"index places this tensor in {shard!r}, which lacks it", file=path, tensor=name)
    return Checkpoint(path, "safetensors", files, tensors, dict(obj["metadata"]), identity, source=source)


def _open_url(url: str) -> Checkpoint:
    """A checkpoint in an object store or behind HTTP: headers by ranged reads, resolved as a
    folder is where the URL names a prefix (one that ends in ``/``, or no object)."""
    from weightlift.sources.objects import Objects

    src = Objects(url)
    p = url
    if url.endswith("/"):
        p = _pick_url(src, url)
    elif src.root.scheme != "s3":  # HTTP: a folder is named with its '/'; a missing file is its 404
        src.info(url)
    elif not src.exists(url):  # a prefix named without its '/'
        p = _pick_url(src, url)
    if p.endswith(".json"):
        return _open_index(p, src)
    if src.magic(p) == b"GGUF" or p.lower().endswith(".gguf"):
        files, tensors, meta = _gguf_set(p, src.location(p).name, src.gguf_header, src.exists, src.sibling)
        return Checkpoint(p, "gguf", files, tensors, meta, source=src)
    tensors, smeta = src.safetensors_header(p)
    return Checkpoint(p, "safetensors", [p], tensors, dict(smeta), source=src)


def _pick_url(src: Objects, url: str) -> str:
    names = src.listing(url)
    if names is None:  # HTTP cannot list: what transformers would look for, in its order
        for n in PREFERRED:
            if src.exists(src.child(url, n)):
                return src.child(url, n)
        raise NotFoundError(f"holds none of {', '.join(PREFERRED)} (an HTTP server cannot be listed)", file=url)
    for n in PREFERRED:
        if n in names:
            return src.child(url, n)
    if not names:
        raise NotFoundError("no such object or prefix", file=url)
    return _pick(url, names, src.child)
