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

import argparse
import sys

from suite import add_arguments, command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(
        p,
        default_arms="local",
        quick_arms="safetensors.numpy,wl.numpy,wl.numpy.nocopy",
        default_baseline="safetensors.numpy",
        default_size_gib=2.0,
    )
    return command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
