"""The research bench's arm bodies: peer loaders and weightlift's variants, run in fresh children.

Loaded by path beside :mod:`weightlift.benchmark.arms` (the arms ``weightlift bench`` runs), which
holds the protocol every arm follows (see its docstring): the same touching, the same ready line,
the same ``os._exit``. In a child this file finds that module as ``sys.modules["wl_bench_arms"]``
(loaded by path: a peer's arm never imports weightlift); imported in the parent it imports it
from the package. ``SPECS`` and ``BODIES`` add to that module's.
"""

from __future__ import annotations

import functools
import importlib
import json
import mmap
import os
import sys
import time
from collections.abc import Callable
from typing import Any

core: Any = sys.modules.get("wl_bench_arms") or importlib.import_module("weightlift.benchmark.arms")
floors: Any = sys.modules.get("wl_bench_floors") or importlib.import_module("weightlift.benchmark.floors")

ArmSpec = core.ArmSpec
READ_LIMIT_THREADS = floors.READ_LIMIT_THREADS


# -- peer loaders --------------------------------------------------------------------------------


def _torch_load(o: dict[str, Any]) -> dict[str, Any]:
    import torch

    t0 = core.start_clock()
    out = torch.load(o["pt"], mmap=True, weights_only=True)
    n, b = core.touch_torch(out.values())
    return {"load_s": core.stop_clock(t0), "tensors": n, "bytes": b}


def _runai(o: dict[str, Any]) -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    t0 = core.start_clock()
    out: dict[str, Any] = {}
    with SafetensorsStreamer() as s:
        s.stream_files(list(o["files"]), device="cpu")
        for name, t in s.get_tensors():
            out[name] = t  # owned by the caller (the default), so keeping it is safe
    n, b = core.touch_torch(out.values())
    return {"load_s": core.stop_clock(t0), "tensors": n, "bytes": b}


def _tensorizer(o: dict[str, Any]) -> dict[str, Any]:
    from tensorizer import TensorDeserializer

    t0 = core.start_clock()
    d = TensorDeserializer(o["tz"], device="cpu", lazy_load=False)  # kept open: os._exit ends the child
    out = dict(d.items())
    n, b = core.touch_torch(out.values())
    return {"load_s": core.stop_clock(t0), "tensors": n, "bytes": b}


def _instanttensor(o: dict[str, Any]) -> dict[str, Any]:
    from instanttensor import safe_open

    core.cuda_context()
    t0 = core.start_clock()
    out: dict[str, Any] = {}
    with safe_open(list(o["files"]), framework="pt", device=0) as f:
        for name, t in f.tensors():
            out[name] = t  # owned by default (copy=True)
    n, b = core.touch_torch(out.values())
    return {"load_s": core.stop_clock(t0), "tensors": n, "bytes": b}


# -- weightlift's variants ------------------------------------------------------------------------

_BENCH_TOKEN = b"weightlift-bench-token-0123456789"


def _tls_contexts() -> tuple[Any, Any]:
    """(server, client) TLS contexts around a fresh self-signed certificate for 127.0.0.1."""
    import datetime
    import ipaddress
    import ssl
    import tempfile

    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise core.Skip("needs the cryptography package to make a certificate") from None
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    folder = tempfile.mkdtemp(prefix="wl-bench-tls-")
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    return server, ssl.create_default_context(cafile=cert_path)


def _wl_push(
    o: dict[str, Any], *, cache: bool = False, verify: bool = False, mac: bool = False, tls: bool = False
) -> dict[str, Any]:
    """The loopback push with a caching server (``cache``), digests reported and checked
    (``verify``), a token, so every frame carries a MAC (``mac``), or over TLS (``tls``: its
    certificate made before the clock starts)."""
    server_tls, client_tls = _tls_contexts() if tls else (None, None)
    token = _BENCH_TOKEN if mac else None
    server = {"cache_dir": o["cache_dir"] if cache else None, "token": token, "tls": server_tls}
    client = {"token": token, "tls": client_tls} if mac or tls else None
    return core.wl_push(o, server=server, client=client, push={"verify": True} if verify else None)


def _wl_push_reserved(o: dict[str, Any]) -> dict[str, Any]:
    """A first push into a Server started with ``reserve=`` the checkpoint's size, once the
    reserve is faulted in (as in a worker that starts its server before its other start-up
    work); the push alone is timed. ``reserve_s`` is how long the reserve took to fault in."""
    from weightlift.checkpoint import open_checkpoint
    from weightlift.memory.pool import POOL_MIN, size_class
    from weightlift.remote.server import Server

    prof = core.profiler(o)
    # what the tensors will take: each of 2 MiB or more gets whole 2 MiB pages
    size = sum(size_class(t.length) for t in open_checkpoint(o["path"]).tensors if t.length >= POOL_MIN)
    t0 = time.perf_counter_ns()
    server = Server("127.0.0.1", 0, reserve=size, profile=prof.enabled)
    addr = server.start()
    try:
        while server.reserved[0] < server.reserved[1]:
            time.sleep(0.005)
        reserve_s = (time.perf_counter_ns() - t0) / 1e9
        return core.timed_push(server, addr, o, prof, stats=True, reserve_s=reserve_s)
    finally:
        server.close()


def _wl_push_again(o: dict[str, Any], *, cache: bool) -> dict[str, Any]:
    """Pushes of the checkpoint to one running Server in this process; the last one is timed.

    Without a cache it is a weight update in steady state: three pushes, the third timed. Every
    byte crosses the wire again, into memory the server released with an earlier version (the
    second push leaves a spare of each size in the pool: a tensor's new version must land
    before its old one may go). With a cache (a fresh folder per run) it is two pushes: the
    first fills the cache and the second finds every large tensor already held. The first push
    is timed too (``first_s``), so the ratio is first over last in the same process.
    """
    import shutil
    import tempfile

    from weightlift.remote.server import Server

    prof = core.profiler(o)
    cache_dir = tempfile.mkdtemp(prefix="wl-second-", dir=o["cache_root"]) if cache else None
    server = Server("127.0.0.1", 0, cache_dir=cache_dir, profile=prof.enabled)
    addr = server.start()
    try:
        t0 = time.perf_counter_ns()
        core.push_touch(server, addr, o["path"])
        first_s = (time.perf_counter_ns() - t0) / 1e9
        if not cache:
            core.push_touch(server, addr, o["path"])  # the update measured is the third push
        return core.timed_push(server, addr, o, prof, stats=True, first_s=first_s)
    finally:
        server.close()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _wl_split(o: dict[str, Any]) -> dict[str, Any]:
    """The second half of the tensors pushed to a server in this process while the first half
    loads locally (weightlift.split.split_load); ready when both halves are in memory."""
    from weightlift.options import LoadOptions
    from weightlift.remote.server import Server
    from weightlift.split import split_load

    with open(o["split_file"], encoding="utf-8") as f:
        remote_names = frozenset(json.load(f))  # exact names: a set is not read as globs
    prof = core.profiler(o)
    t0 = time.perf_counter_ns()
    server = Server("127.0.0.1", 0, profile=prof.enabled)
    host, port = server.start()
    try:
        res = split_load(o["path"], LoadOptions(remote={f"{host}:{port}": remote_names}, profile=core.prof_arg(prof)))
        n, b = core.touch_any(res.local.values())
        rn, rb = core.touch_any(server.tensors().values())
        info: dict[str, Any] = {
            "load_s": (time.perf_counter_ns() - t0) / 1e9,
            "tensors": n + rn,
            "bytes": b + rb,
            "local_bytes": b,
            "remote_bytes": rb,
        }
        if prof.enabled:
            info["profile"] = prof.report()
            info["server_profile"] = core.server_report(server)
    finally:
        server.close()
    return info


# -- profiler overhead probe --------------------------------------------------------------------


def _profile_loop(o: dict[str, Any]) -> dict[str, Any]:
    """Read every tensor into fresh arrays in loader-sized calls, with the profiler code path
    absent ("plain"), present but off ("off": one ``if prof.enabled:`` per clock read), or on."""
    import numpy as np

    from weightlift.checkpoint import open_checkpoint
    from weightlift.profile import Profiler

    mode = o["mode"]
    prof = Profiler(enabled=(mode == "on"))
    ck = open_checkpoint(o["path"])
    step = 16 * 1024 * 1024
    t_load = time.perf_counter_ns()
    out = []
    calls = 0
    fds = {f: os.open(f, os.O_RDONLY) for f in ck.files}
    for t in ck.tensors:
        dst = np.empty(t.length, dtype=np.uint8)
        view = dst.data
        fd = fds[t.file]
        for pos in range(0, t.length, step):
            n = min(step, t.length - pos)
            if mode == "plain":
                os.preadv(fd, [view[pos : pos + n]], t.offset + pos)
            else:
                if prof.enabled:
                    t0 = time.perf_counter_ns()
                os.preadv(fd, [view[pos : pos + n]], t.offset + pos)
                if prof.enabled:
                    prof.record("read", t0, time.perf_counter_ns(), n)
                    prof.count(calls=1)
            calls += 1
        out.append(dst)
    for fd in fds.values():
        os.close(fd)
    n, b = core.touch_numpy(out)
    info: dict[str, Any] = {
        "load_s": (time.perf_counter_ns() - t_load) / 1e9,
        "tensors": n,
        "bytes": b,
        "read_calls": calls,
    }
    if prof.enabled:
        info["profile"] = prof.report()
    return info


# -- research floors ---------------------------------------------------------------------------


def _limit_fault(o: dict[str, Any], huge: bool = False) -> dict[str, Any]:
    """The floor for landing the checkpoint in memory a fresh process has never touched: a
    private anonymous mapping of its size (huge pages advised or not) faulted in, one write
    per page, one share per core; nothing is copied and nothing read. A receiver that keeps
    every byte in fresh memory (a freshly started server, a split load) pays at least the
    faster of the two, unless its copy faults pages more cheaply than a write per page does."""
    import numpy as np

    size = floors.data_size(o["files"][0]) if len(o["files"]) == 1 else sum(os.path.getsize(f) for f in o["files"])
    t0 = time.perf_counter_ns()
    dst = np.frombuffer(floors.fresh_mapping(size, huge), dtype=np.uint8)
    shares = floors.split_shares(size, os.cpu_count() or 1)

    def work(i: int) -> None:
        a, b = shares[i]
        dst[a : b : core.PAGE] = 1

    floors.run_threads(work, len(shares))
    return {
        "load_s": (time.perf_counter_ns() - t0) / 1e9,
        "tensors": 0,
        "bytes": size,
        "threads": len(shares),
        "huge": huge,
    }


def _limit_read_fresh(o: dict[str, Any], k: int) -> dict[str, Any]:
    """The raw read into fresh memory: ``k`` threads of preadv, one contiguous share each,
    straight into one fresh anonymous mapping of the file's size (4 KiB pages, each 8 MiB piece
    populated just before it is read, the fastest fill measured here), then every page touched.

    An owned copy of a cold file has to land in memory the process never touched; the plain raw
    read (limit.read.k) reads into buffers it reuses, so it pays no page faults. This arm is the
    like-for-like floor for a cold owned-copy load."""
    import numpy as np

    path = o["files"][0] if len(o["files"]) == 1 else None
    if path is None:
        raise core.Skip("the read limit measures a single file")
    t0 = time.perf_counter_ns()
    size = floors.data_size(path)
    m = floors.fresh_mapping(size, huge=False)
    mv = memoryview(m)
    populate = getattr(mmap, "MADV_POPULATE_WRITE", 23)
    fd = os.open(path, os.O_RDONLY)
    try:
        shares = floors.split_shares(size, k)

        def work(i: int) -> None:
            a, b = shares[i]
            for x in range(a, b, core.BLOCK):
                y = min(b, x + core.BLOCK)
                try:
                    m.madvise(populate, x, y - x)
                except OSError:
                    pass
                pos = x
                while pos < y:
                    n = os.preadv(fd, [mv[pos:y]], pos)
                    if n <= 0:
                        raise OSError(f"short read at {pos}")
                    pos += n

        floors.run_threads(work, len(shares))
    finally:
        os.close(fd)
    mv.release()
    n, b = core.touch_any([np.frombuffer(m, dtype=np.uint8)])
    return {"load_s": (time.perf_counter_ns() - t0) / 1e9, "tensors": 0, "bytes": b, "threads": k}


def _make_tensorizer(o: dict[str, Any]) -> dict[str, Any]:
    """Write the checkpoint's tensors in tensorizer's format (for the tensorizer arm)."""
    from safetensors.torch import load_file
    from tensorizer import TensorSerializer

    tensors: dict[str, Any] = {}
    for f in o["files"]:
        tensors.update(load_file(f))
    tmp = o["tz"] + ".tmp"
    s = TensorSerializer(tmp)
    s.write_state_dict(tensors)
    s.close()
    os.replace(tmp, o["tz"])
    return {"tensors": len(tensors)}


def _make_pt(o: dict[str, Any]) -> dict[str, Any]:
    """Write the checkpoint's tensors as a torch zip file (for the torch.load arm)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in o["files"]:
        tensors.update(load_file(f))
    tmp = o["pt"] + ".tmp"
    torch.save(tensors, tmp)
    os.replace(tmp, o["pt"])
    return {"tensors": len(tensors)}


# -- the arm table ------------------------------------------------------------------------------

_WL_PUSH_REQ = ("weightlift.remote.server", "weightlift.remote.client")

SPECS: dict[str, Any] = {
    s.name: s
    for s in (
        ArmSpec(
            "torch.load",
            "local",
            "torch.load(mmap=True) of a .pt copy",
            ("torch", "safetensors"),
            uses_pt=True,
            safetensors_only=True,
        ),
        ArmSpec(
            "tensorizer",
            "local",
            "tensorizer TensorDeserializer(device='cpu') of a tensorizer copy",
            ("tensorizer", "safetensors", "torch"),
            uses_tensorizer=True,
            safetensors_only=True,
        ),
        ArmSpec(
            "instanttensor",
            "local",
            "instanttensor safe_open(device=0): it loads into CUDA devices only",
            ("instanttensor", "torch"),
            cuda=True,
            safetensors_only=True,
        ),
        ArmSpec(
            "runai",
            "local",
            "runai_model_streamer SafetensorsStreamer to cpu",
            ("runai_model_streamer", "torch"),
            safetensors_only=True,
        ),
        ArmSpec(
            "wl.numpy.mmap",
            "local",
            "weightlift.load(framework='numpy', engine='mmap'): a copy out of the mapping (the default reads with preadv)",
            ("weightlift.api",),
            weightlift=True,
        ),
        ArmSpec(
            "wl.numpy.nohelpers",
            "local",
            "wl.numpy with no fault-ahead helpers (cold readers fault their own chunks)",
            ("weightlift.api",),
            weightlift=True,
            env={"WEIGHTLIFT_FAULT_HELPERS": "0"},
        ),
        ArmSpec(
            "wl.numpy.verify",
            "local",
            "weightlift.load(framework='numpy', verify=True): every tensor hashed as it lands and "
            "compared with the checkpoint's sidecar manifest (made by the warm-up)",
            ("weightlift.api",),
            weightlift=True,
        ),
        ArmSpec(
            "wl.numpy.profiled", "probe", "weightlift.load(framework='numpy') with the profiler on", ("weightlift.api",)
        ),
        ArmSpec(
            "wl.numpy.hugeahead",
            "local",
            "wl.numpy with huge pages and every kernel copy faulted ahead by touch (the fill before the policy)",
            ("weightlift.api",),
            weightlift=True,
            env={"WEIGHTLIFT_HUGEPAGES": "1", "WEIGHTLIFT_FAULT_AHEAD": "1", "WEIGHTLIFT_FAULT_METHOD": "touch"},
        ),
        ArmSpec(
            "wl.push.hugeahead",
            "remote",
            "wl.push with huge pages and every kernel copy faulted ahead by touch (the fill before the policy)",
            _WL_PUSH_REQ,
            weightlift=True,
            env={"WEIGHTLIFT_HUGEPAGES": "1", "WEIGHTLIFT_FAULT_AHEAD": "1", "WEIGHTLIFT_FAULT_METHOD": "touch"},
        ),
        ArmSpec(
            "wl.push.nohelpers",
            "remote",
            "wl.push with no fault-ahead helper threads in the server",
            _WL_PUSH_REQ,
            weightlift=True,
            env={"WEIGHTLIFT_FAULT_HELPERS": "0"},
        ),
        ArmSpec(
            "wl.push.verify",
            "remote",
            "wl.push with verify=True: the server hashes every tensor as it lands, the client checks "
            "the digests against the sidecar manifest (made by the warm-up)",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.mac",
            "remote",
            "wl.push with a token: every frame, payloads included, carries a keyed-BLAKE3 MAC",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.tls",
            "remote",
            "wl.push over TLS (no token): sends without sendfile or scatter-gather",
            (*_WL_PUSH_REQ, "ssl", "cryptography"),
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.legacy",
            "remote",
            "the same push with WEIGHTLIFT_LOAD_OPT=0",
            _WL_PUSH_REQ,
            weightlift=True,
            env={"WEIGHTLIFT_LOAD_OPT": "0"},
        ),
        ArmSpec(
            "wl.push.cached",
            "remote",
            "a second push to a caching server (cache filled by the warm-up)",
            (*_WL_PUSH_REQ, "weightlift.remote.server.cache"),
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.update",
            "remote",
            "a weight update (third push, same shapes) into a running server, timed alone",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.reserved",
            "remote",
            "a first push into a server started with reserve= (faulted), timed alone",
            _WL_PUSH_REQ,
            weightlift=True,
        ),
        ArmSpec(
            "wl.push.second",
            "remote",
            "two pushes to one caching server (fresh cache): the second, timed alone",
            (*_WL_PUSH_REQ, "weightlift.remote.server.cache"),
            weightlift=True,
        ),
        ArmSpec(
            "wl.split",
            "remote",
            "weightlift.load with half the tensors remote",
            ("weightlift.api", "weightlift.remote.server"),
            weightlift=True,
        ),
        *(
            ArmSpec(
                f"limit.read.fresh.{k}",
                "limit",
                f"raw read into fresh memory: {k} preadv thread(s) into one fresh mapping "
                "(4 KiB pages, populated ahead), every page touched, fresh process",
                ("numpy",),
            )
            for k in READ_LIMIT_THREADS
        ),
        ArmSpec(
            "limit.fault",
            "limit",
            "fault-in floor: fresh memory of the checkpoint's size faulted in on every "
            "core (one write per 4 KiB page), nothing copied, fresh process",
            ("numpy",),
        ),
        ArmSpec("limit.fault.huge", "limit", "the fault-in floor with huge pages advised", ("numpy",)),
        ArmSpec("loop.plain", "probe", "read loop with no profiler code", ("weightlift.checkpoint",)),
        ArmSpec(
            "loop.off", "probe", "the same loop with the profiler checks, profiler off", ("weightlift.checkpoint",)
        ),
        ArmSpec("loop.on", "probe", "the same loop with the profiler on", ("weightlift.checkpoint",)),
    )
}

BODIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "torch.load": _torch_load,
    "runai": _runai,
    "tensorizer": _tensorizer,
    "instanttensor": _instanttensor,
    "wl.numpy.profiled": lambda o: core.wl_load({**o, "profile": True}, framework="numpy", copy=True),
    "wl.numpy.mmap": lambda o: core.wl_load(o, framework="numpy", copy=True, engine="mmap"),
    "wl.numpy.nohelpers": lambda o: core.wl_load(o, framework="numpy", copy=True),
    "wl.numpy.verify": lambda o: core.wl_load(o, framework="numpy", copy=True, verify=True),
    "wl.numpy.hugeahead": lambda o: core.wl_load(o, framework="numpy", copy=True),
    "wl.push.legacy": _wl_push,
    "wl.push.hugeahead": _wl_push,
    "wl.push.nohelpers": _wl_push,
    "wl.push.cached": lambda o: _wl_push(o, cache=True),
    "wl.push.verify": lambda o: _wl_push(o, verify=True),
    "wl.push.mac": lambda o: _wl_push(o, mac=True),
    "wl.push.tls": lambda o: _wl_push(o, tls=True),
    "wl.push.update": lambda o: _wl_push_again(o, cache=False),
    "wl.push.second": lambda o: _wl_push_again(o, cache=True),
    "wl.push.reserved": _wl_push_reserved,
    "wl.split": _wl_split,
    "limit.fault": _limit_fault,
    "limit.fault.huge": lambda o: _limit_fault(o, huge=True),
    **{f"limit.read.fresh.{k}": functools.partial(_limit_read_fresh, k=k) for k in READ_LIMIT_THREADS},
    "loop.plain": lambda o: _profile_loop({**o, "mode": "plain"}),
    "loop.off": lambda o: _profile_loop({**o, "mode": "off"}),
    "loop.on": lambda o: _profile_loop({**o, "mode": "on"}),
    "make-pt": _make_pt,
    "make-tensorizer": _make_tensorizer,
}
