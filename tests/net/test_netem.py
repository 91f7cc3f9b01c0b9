"""A push over a slow, lossy, reordering link between two network namespaces.

``weightlift serve`` runs in one namespace, ``weightlift push`` and ``weightlift pull`` in the
other, as separate processes of the command line; the link delays, drops and reorders the
packets of the push (``tc netem``, or its user-space stand-in where the kernel lacks netem:
see :mod:`tests.net.netns`). What the server holds, pulled back over the link, must equal the
checkpoint byte for byte. Sizes are small so the test takes a few seconds; no time is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import weightlift as wl
from tests.checkpoints import byte_length, raw_bytes, write
from tests.net.netns import ROOT, has_netem, impair_unavailable

CLI = [sys.executable, "-m", "weightlift.cli"]
LAYOUT = [  # about 6 MiB: some 700 packets of 9000 bytes, so 1 % loss and 5 % reordering happen
    ("embed.weight", "F16", (1000, 1024)),
    ("layer.0.weight", "F32", (512, 1024)),
    ("layer.0.bias", "F32", (1024,)),
    ("layer.1.weight", "BF16", (1024, 1024)),
    ("norm", "F32", (7,)),
    ("empty", "F32", (0, 4)),
]


def _tensors() -> list[tuple[str, str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(10)
    return [(n, d, s, rng.integers(0, 256, byte_length(d, s), dtype=np.uint8).tobytes()) for n, d, s in LAYOUT]


def _token(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


def test_push_over_a_slow_lossy_reordering_link_is_byte_exact(net, tmp_path):
    if impair_unavailable():
        pytest.skip(impair_unavailable())
    (ns_client, _, _), (ns_server, _, server_addr) = net.impaired_pair(delay_ms=20, loss=0.01, reorder=0.05, seed=7)
    tensors = _tensors()
    path = write(tmp_path / "model.safetensors", tensors)
    token = _token(tmp_path)
    server, to = net.serve(ns_server, server_addr, "--token-file", token, "--max-memory", "256M")

    pushed = net.run(
        ns_client, [*CLI, "push", str(path), "--to", to, "--token-file", token, "--streams", "3", "--json"]
    )
    assert pushed.returncode == 0, pushed.stderr
    result = json.loads(pushed.stdout)
    assert result["tensors"] == len(tensors) and result["bytes"] == sum(len(r) for *_, r in tensors), result

    listed = net.run(ns_client, [*CLI, "ls", "--from", to, "--token-file", token, "--json"])
    assert listed.returncode == 0, listed.stderr
    assert sorted((e["name"], e["dtype"], tuple(e["shape"])) for e in json.loads(listed.stdout)) == sorted(
        (n, d, s) for n, d, s, _ in tensors
    )

    out = tmp_path / "pulled.safetensors"
    pulled = net.run(ns_client, [*CLI, "pull", "--from", to, "--token-file", token, "-o", str(out)])
    assert pulled.returncode == 0, pulled.stderr
    got = wl.load(str(out))
    assert set(got) == {n for n, *_ in tensors}
    for name, _, shape, raw in tensors:
        assert tuple(got[name].shape) == shape and raw_bytes(got[name]) == raw, name

    seen = net.impairment()
    if seen is not None:  # the user-space link counts what it did; netem's is the kernel's word
        assert seen["dropped"] > 0 and seen["reordered"] > 0, seen
    else:
        assert has_netem()


def test_the_link_is_removed_with_the_fixture(net):
    ends = net.pair()
    names = [ns for ns, _, _ in ends]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(n in listed for n in names)
    net.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert not subprocess.run(["ip", "link", "show", ends[0][1]], capture_output=True).returncode == 0


def test_namespaces_of_a_killed_run_are_swept(net):
    # a process that makes a namespace and dies without closing, as a run killed with -9 would
    code = "import os; from tests.net.netns import Net; n = Net(); print(n.namespace(), flush=True); os._exit(0)"
    left = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    name = left.stdout.strip()
    assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    from tests.net.netns import Net

    Net().close()
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_a_rate_capped_pair_carries_a_verified_push(net, tmp_path):
    """``pair(rate=...)`` puts a token bucket on the first end (what bench/verify_link.py uses);
    a verified push crosses it and the server's digests match the file's."""
    ends = net.pair("10.234.0", rate="200mbit")
    (ns_a, dev_a, _), (ns_b, _, addr) = ends
    shown = subprocess.run(["tc", "-n", ns_a, "qdisc", "show", "dev", dev_a], capture_output=True, text=True)
    assert "tbf" in shown.stdout and "200Mbit" in shown.stdout
    rng = np.random.default_rng(3)
    tensors = [(n, d, s, rng.integers(0, 256, byte_length(d, s), dtype=np.uint8).tobytes()) for n, d, s in LAYOUT]
    path = write(tmp_path / "m.safetensors", tensors)
    server, to = net.serve(ns_b, addr, "--insecure")
    r = net.run(ns_a, [*CLI, "push", str(path), "--to", to, "--verify", "--json"], cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["bytes"] == sum(len(raw) for *_, raw in tensors)
    assert res["verified"] == len(tensors)
