#!/usr/bin/env python3
"""Remote push: weightlift's client and server over loopback against raw TCP and the legacy path.

Arms (fresh process each; the server runs inside the child, so the window is spawn to every
pushed tensor in the server's memory and touched): the push, the same push with
WEIGHTLIFT_LOAD_OPT=0 (legacy), a second push to a caching server (the warm-up fills the
cache), and a split load (half local, half pushed). The raw loopback TCP baseline
(sendfile to recv_into, no protocol) is the ceiling.

    python bench/remote.py --json remote.json --png remote.png
    python bench/remote.py --quick
"""

from __future__ import annotations

import sys

from _common import table_main


def main(argv: list[str] | None = None) -> int:
    return table_main(
        __doc__,
        argv,
        default_arms="remote",
        quick_arms="wl.push,wl.push.legacy",
        default_baseline="wl.push.legacy",
        default_size_gib=2.0,
    )


if __name__ == "__main__":
    sys.exit(main())
