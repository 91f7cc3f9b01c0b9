"""One digest over a set of named tensors: a Merkle root over their BLAKE3 digests.

The tree, so that any implementation computes the same root:

* a leaf per tensor, in the order of the names' UTF-8 bytes:
  ``BLAKE3(0x00 || len(name):u16 LE || name || digest)``, the name in UTF-8, the digest 32 bytes;
* each level pairs its nodes from the left: ``BLAKE3(0x01 || left || right)``; a node left
  without a partner moves up as it is;
* the root is the last node left; the root of no tensors is ``BLAKE3(0x02)``.

The prefixes keep a leaf, an inner node and the empty set apart; the name in each leaf binds
every digest to its tensor, so two tensors' bytes swapped give another root.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

import blake3

from weightlift.errors import OptionError

__all__ = ["set_digest", "leaf_digest"]

_LEAF, _NODE, _EMPTY = b"\x00", b"\x01", b"\x02"


def leaf_digest(name: str, digest: bytes) -> bytes:
    """The leaf of one tensor: its name and the BLAKE3 digest of its bytes."""
    raw = name.encode("utf-8")
    if len(digest) != 32 or len(raw) > 0xFFFF:
        raise OptionError(f"set digest: tensor {name!r} needs a 32-byte digest and a name under 64 KiB")
    return blake3.blake3(_LEAF + struct.pack("<H", len(raw)) + raw + bytes(digest)).digest()


def set_digest(digests: Mapping[str, bytes] | Iterable[tuple[str, bytes]]) -> bytes:
    """The Merkle root over ``{name: digest}`` (see the module docstring for the tree)."""
    pairs = digests.items() if isinstance(digests, Mapping) else digests
    level = [leaf_digest(n, d) for n, d in sorted(pairs, key=lambda kv: kv[0].encode("utf-8"))]
    if not level:
        return blake3.blake3(_EMPTY).digest()
    while len(level) > 1:
        nxt = [blake3.blake3(_NODE + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]
