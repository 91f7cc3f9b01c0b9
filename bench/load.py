#!/usr/bin/env python3
"""Local loading: weightlift's loader arms against peers and the machine's limits.

Arms (each in a fresh process, spawn to every page touched, interleaved, 1 warm-up + N runs):
weightlift.load numpy copy / no-copy / torch / cuda, safetensors.numpy, safetensors.torch
(and to cuda), torch.load(mmap=True) of a .pt copy, runai-model-streamer. Baselines in the same
run: copy limit, best raw read, loopback TCP, pinned host-to-device.

    python bench/load.py --json load-warm.json --png load-warm.png
    python bench/load.py --cold --json load-cold.json --png load-cold.png
    python bench/load.py --quick
"""

from __future__ import annotations

import sys

from _common import table_main


def main(argv: list[str] | None = None) -> int:
    return table_main(
        __doc__,
        argv,
        default_arms="local",
        quick_arms="safetensors.numpy,wl.numpy,wl.numpy.nocopy",
        default_baseline="safetensors.numpy",
        default_size_gib=2.0,
    )


if __name__ == "__main__":
    sys.exit(main())
