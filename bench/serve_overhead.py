#!/usr/bin/env python3
"""What serving metrics and logs costs a push: ``weightlift serve`` quiet against the same server
with ``--log-level info --metrics``.

Two servers run side by side on loopback, started once each:

* quiet - ``--log-level warning``, no metrics endpoint (nothing is logged for a clean push);
* observed - ``--log-level info --metrics 127.0.0.1:0``, its endpoint scraped after every push
  (the scrape is outside the push's clock, as a Prometheus scrape is outside a client's).

Each run is ``weightlift push PATH --to ADDR --json`` in a fresh process, arms interleaved
(quiet, observed, quiet, ...), and compared on the push's own ``seconds`` (interpreter start and
imports excluded); the server's tensors are freed after each push so every push lands in memory
the same way. Reports each arm's median and spread and the ratio observed / quiet of the medians,
and of each pair of runs.

    python bench/serve_overhead.py --runs 7 --json serve-overhead.json
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import CLI, ROOT, add_run_arguments, checkpoint, parser, write_json

ARMS = {
    "quiet": ["--log-level", "warning"],
    "observed": ["--log-level", "info", "--metrics", "127.0.0.1:0"],
}


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _serve(extra: list[str], ready: Path) -> tuple[subprocess.Popen[str], str, str | None]:
    """A ``weightlift serve`` with ``extra``: the process, its address, its metrics URL (or None)."""
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", "0", "--ready-file", str(ready), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the log lines are made and written; nobody needs to read them here
        text=True,
        env=_env(),
    )
    url = None
    if "--metrics" in extra:
        assert proc.stdout is not None
        url = proc.stdout.readline().split(" on ", 1)[1].strip()
    end = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().endswith("\n")):
        if time.monotonic() > end or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"weightlift serve {' '.join(extra)} did not get ready")
        time.sleep(0.05)
    return proc, ready.read_text().strip(), url


def _push(path: str, address: str, timeout: float) -> float:
    out = subprocess.run(
        [*CLI, "push", path, "--to", address, "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        check=True,
    )
    seconds: float = json.loads(out.stdout)["seconds"]
    return seconds


def _free_all(address: str) -> None:
    from weightlift.remote.client.client import Client

    with Client(address) as c:
        c.free([t.name for t in c.list()])


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    add_run_arguments(p, size_mib=256, runs=7, settle=0.5)
    a = p.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    path = checkpoint(a)
    servers: dict[str, tuple[subprocess.Popen[str], str, str | None]] = {}
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for arm, extra in ARMS.items():
                servers[arm] = _serve(extra, Path(tmp) / f"{arm}.ready")
            for arm in ARMS:  # one untimed push each: first-touch costs out of the way
                _push(path, servers[arm][1], a.timeout)
                _free_all(servers[arm][1])
            for _ in range(a.runs):
                for arm in ARMS:
                    time.sleep(a.settle)
                    _, address, url = servers[arm]
                    times[arm].append(_push(path, address, a.timeout))
                    if url is not None:
                        urllib.request.urlopen(url, timeout=10).read()
                    _free_all(address)
        finally:
            for proc, _, _ in servers.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    result: dict[str, Any] = {"path": path, "bytes": os.path.getsize(path), "runs": a.runs, "seconds": times}
    for arm, ts in times.items():
        result[f"{arm}_median_s"] = statistics.median(ts)
        result[f"{arm}_spread_s"] = [min(ts), max(ts)]
        print(f"{arm:<9} median {statistics.median(ts):.4f} s  (min {min(ts):.4f}, max {max(ts):.4f}, n={len(ts)})")
    ratio = result["observed_median_s"] / result["quiet_median_s"]
    pairs = [o / q for o, q in zip(times["observed"], times["quiet"], strict=True)]
    result["ratio_observed_over_quiet"] = ratio
    result["paired_ratio_median"] = statistics.median(pairs)
    print(f"observed / quiet: {ratio:.3f} (median of the {len(pairs)} paired ratios {statistics.median(pairs):.3f})")
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
