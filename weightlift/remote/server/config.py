"""A server's settings as one frozen value, checked once when the server is made.

:class:`ServerConfig` holds every option of :class:`~weightlift.remote.server.Server` in its
resolved form (a token as bytes, TLS folded into the backend, the memory cap worked out for the
device); :func:`configure` builds it from the server's keywords, in the order a user should
hear about mistakes: the transport, then the device (without allocating anything on it), then
the memory cap. The limits' defaults are named here; SECURITY.md explains each.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any, Literal, Protocol, TypedDict

from weightlift import env
from weightlift.errors import DeviceError, OptionError
from weightlift.memory.targets import Target, cuda_device, target_for
from weightlift.options import Placement
from weightlift.remote.protocol import PROTOCOL_MINOR, LayoutReply
from weightlift.remote.token import check_token, token_bytes
from weightlift.remote.transport import TCP, Backend, TlsBackend

__all__ = [
    "ServerConfig",
    "ServerOptions",
    "INPUT_ONLY",
    "CONFIG_ONLY",
    "configure",
    "is_loopback",
    "default_max_memory",
    "MAX_CONNECTIONS",
    "MAX_HANDSHAKES",
    "MAX_PER_ADDRESS",
    "HANDSHAKE_TIMEOUT",
    "IDLE_TIMEOUT",
    "IO_TIMEOUT",
    "GATE_TIMEOUT",
    "MIN_FRAME_RATE",
    "MEMORY_FRACTION",
    "CUDA_HEADROOM",
    "cuda_budget",
    "Slices",
    "ShardRules",
]

MAX_CONNECTIONS = 64  # READY (authenticated) connections served at once; more are closed at accept
MAX_HANDSHAKES = 16  # connections still in HELLO/AUTH at once, apart from the READY ones
MAX_PER_ADDRESS = 32  # connections from one peer address (loopback: all of it; IPv6: a /64) at once, of both kinds
HANDSHAKE_TIMEOUT = 10.0  # seconds from accept for a connection to become READY (HELLO, AUTH)
IDLE_TIMEOUT = 300.0  # seconds a READY connection may wait between requests before it is closed
IO_TIMEOUT = 60.0  # seconds one receive inside a frame or payload, or one send, may wait
# the most seconds an in-place commit waits for the READs (and other in-place commits) of what
# it changes (less where io_timeout is less): without a bound a reader that stops taking its
# reply holds its tensor, and the commit, for good; and it is below a client's default timeout
# (30 s), so that a client waiting for its COMMIT's reply hears the refusal instead of giving up
# while the server may still switch the update in
GATE_TIMEOUT = 20.0
MIN_FRAME_RATE = 64 * 1024  # bytes per second: a frame of N bytes must arrive within IO_TIMEOUT + N / this
MEMORY_FRACTION = 0.9  # of physical RAM: a cpu server's max_memory when none is given
# of a device's total memory (at least 1 GiB), left free under a CUDA server's default max_memory:
# the caching allocator rounds every block up and fragments, and kernels (a reader's copies, a
# commit's delta) allocate workspaces beside the tensors
CUDA_HEADROOM = 0.05
_CUDA_HEADROOM_MIN = 1 << 30


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (so no token is needed to bind it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cuda_budget(free: int, total: int) -> int:
    """A CUDA server's default max_memory on a device with ``free`` of ``total`` bytes free: what
    is free, less :data:`CUDA_HEADROOM`. Not the total: the CUDA context, other processes and
    what torch already holds are not the server's to fill. The pinned host staging of the
    connections is charged to the same cap (it is memory the server makes), so the tensors get
    less, never more, than the device has."""
    return max(0, free - max(_CUDA_HEADROOM_MIN, int(total * CUDA_HEADROOM)))


def default_max_memory(device: str | Placement = "cpu") -> int:
    """The memory cap a server uses when given none: 90 % of physical RAM for ``cpu``, for
    ``cuda[:N]`` what is free on the device now less headroom (:func:`cuda_budget`). OptionError
    where the amount cannot be found."""
    place = device if isinstance(device, Placement) else Placement(device=device, framework="torch")
    dev = place.device
    if place.cuda:
        import torch

        try:
            free, total = torch.cuda.mem_get_info(torch.device(dev))
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)  # torch's to reuse
            return cuda_budget(int(free) + int(cached), int(total))
        except (RuntimeError, AssertionError, ValueError) as e:
            raise DeviceError(f"cannot read the memory of device {dev!r}: {e}") from None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        raise OptionError("cannot tell how much memory this machine has: pass max_memory") from None
    return int(total * MEMORY_FRACTION)


def _current_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def check_device(place: Placement) -> Target | None:
    """Fail now on a device the server cannot use, without allocating anything on it.

    Returns the host target all connections share (it holds no state), or None for a CUDA
    device: each connection makes its own CUDA target, with its pinned slots, at its first ALLOC.
    """
    if not place.cuda:
        return target_for(place)
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(f"device {place.device!r} asked for, but torch sees no CUDA device")
    if place.index is not None and place.index >= torch.cuda.device_count():
        raise DeviceError(f"device {place.device!r} asked for, but torch sees {torch.cuda.device_count()} CUDA devices")
    return None


Box = tuple[tuple[int, int], ...]


class Slices(Protocol):
    """The slices a sharded server holds, as its receive path asks about them: its rank's
    segments of a tensor (a box of the unsharded tensor, the split dimension or None, and where
    the box starts along it in the local buffer), the local shape, a box's part of the tensor's
    linear sketch, and the LAYOUT_REPLY that tells a sender all of it.
    :class:`weightlift.distributed.regions.Served` is the implementation (``Shard.serving()``)."""

    @property
    def rank(self) -> int: ...

    def segments(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[tuple[Box, int | None, int], ...]: ...

    def local_shape(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def sketch(self, array: Any, shape: tuple[int, ...], box: Box, name: str) -> int: ...

    def describe(self) -> LayoutReply: ...


class ShardRules(Protocol):
    """What ``Server(shard=...)`` takes: a :class:`weightlift.distributed.Shard` with rank and world."""

    def serving(self, parts: Mapping[str, Sequence[int]] | None = None) -> Slices: ...


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Every setting of a server, resolved and checked (see :class:`~weightlift.remote.server.Server`
    for what each means). ``naive`` is ``WEIGHTLIFT_LOAD_OPT=0``: the naive receive path, for A/B
    runs."""

    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    framework: str = "numpy"
    cache_dir: str | os.PathLike[str] | None = None
    cache_max_bytes: int | Literal["auto"] | None = "auto"
    token: bytes | None = field(default=None, repr=False)  # a secret: never in a log line or a traceback
    max_memory: int
    reserve: int = 0
    max_connections: int = MAX_CONNECTIONS
    max_handshakes: int = MAX_HANDSHAKES
    max_per_address: int = MAX_PER_ADDRESS
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    idle_timeout: float | None = IDLE_TIMEOUT
    io_timeout: float | None = IO_TIMEOUT
    min_frame_rate: int | None = MIN_FRAME_RATE
    profile: bool | None = None
    protocol_minor: int = PROTOCOL_MINOR
    backend: Backend = TCP
    # what this server presents to the next hop of a relayed push: the fleet's token (its own
    # by default) and a client TLS context; never taken from the wire
    peer_token: bytes | None = field(default=None, repr=False)
    peer_tls: ssl.SSLContext | None = None
    naive: bool = False
    slices: Slices | None = None  # Server(shard=...): the slices it holds, taken as REGIONs (minor 6)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise OptionError(f"port {self.port!r} is out of range")
        if self.max_memory < 0:
            raise OptionError(f"max_memory must be >= 0, got {self.max_memory}")
        for what, n in (
            ("max_connections", self.max_connections),
            ("max_handshakes", self.max_handshakes),
            ("max_per_address", self.max_per_address),
        ):
            if n < 1:
                raise OptionError(f"{what} must be >= 1, got {n}")
        if not self.handshake_timeout > 0:
            raise OptionError(f"handshake_timeout must be > 0, got {self.handshake_timeout}")
        for what, t in (
            ("idle_timeout", self.idle_timeout),
            ("io_timeout", self.io_timeout),
            ("min_frame_rate", self.min_frame_rate),
        ):
            if t is not None and not t > 0:
                raise OptionError(f"{what} must be > 0 or None, got {t}")
        if not 0 <= self.protocol_minor <= PROTOCOL_MINOR:
            raise OptionError(f"protocol_minor must be between 0 and {PROTOCOL_MINOR}")
        if self.token is not None:
            check_token(self.token)
        if not 0 <= self.reserve <= self.max_memory:
            raise OptionError(f"reserve must be between 0 and max_memory ({self.max_memory}), got {self.reserve}")

    @cached_property
    def placement(self) -> Placement:
        """The device and framework as one checked value, for the server's code to pass around
        instead of the strings."""
        return Placement(device=self.device, framework=self.framework)

    @property
    def gate_timeout(self) -> float:
        """How long an in-place commit waits for the READs sending what it changes, then is
        refused with nothing changed: ``io_timeout``, at most :data:`GATE_TIMEOUT`."""
        return GATE_TIMEOUT if self.io_timeout is None else min(self.io_timeout, GATE_TIMEOUT)


class ServerOptions(TypedDict, total=False):
    """The keywords :class:`~weightlift.remote.server.Server` takes after ``host`` and ``port``,
    each as the user gives it (see ``Server`` for what each means). This is the one list of them:
    ``Server`` takes ``**options: Unpack[ServerOptions]``, and each key but those in
    :data:`INPUT_ONLY` is a field of :class:`ServerConfig`, its checked, resolved form (a test
    holds the two together). A key left out takes the config field's default."""

    device: str
    framework: str
    cache_dir: str | os.PathLike[str] | None
    cache_max_bytes: int | Literal["auto"] | None
    token: str | bytes | None
    insecure: bool
    max_memory: int | None
    reserve: int
    max_connections: int
    max_handshakes: int
    max_per_address: int
    handshake_timeout: float
    idle_timeout: float | None
    io_timeout: float | None
    min_frame_rate: int | None
    profile: bool | None
    protocol_minor: int
    backend: Backend
    tls: ssl.SSLContext | None
    shard: ShardRules | None
    fused: Mapping[str, Sequence[int]] | None
    peer_token: str | bytes | None
    peer_tls: ssl.SSLContext | None


#: Options that are no field of the config: ``tls`` is folded into the backend, ``insecure``
#: only allows a bind without a token, ``shard`` and ``fused`` into ``slices``.
INPUT_ONLY = frozenset({"insecure", "tls", "shard", "fused"})
#: Config fields no option sets: the address comes positionally, ``naive`` from the environment,
#: ``slices`` from ``shard`` and ``fused``.
CONFIG_ONLY = frozenset({"host", "port", "naive", "slices"})
#: What a missing option means where the config field has no default (or another one).
_INPUT_DEFAULTS: dict[str, Any] = {"insecure": False, "tls": None, "max_memory": None, "shard": None, "fused": None}


def configure(host: str, port: int, options: ServerOptions) -> tuple[ServerConfig, Target | None]:
    """The checked config for a server's options, and the host target its connections share
    (None for a CUDA device). Warns (as the caller's caller) when binding beyond this machine
    without a token. TypeError for a keyword that is no option, as for any function."""
    unknown = sorted(set(options) - set(ServerOptions.__annotations__))
    if unknown:
        raise TypeError(f"Server() got an unexpected keyword argument {unknown[0]!r}")
    o: dict[str, Any] = {f.name: f.default for f in fields(ServerConfig) if f.default is not MISSING}
    o.update(_INPUT_DEFAULTS)
    o.update(options)
    backend, tls = o["backend"], o["tls"]
    if tls is not None:
        if backend is not TCP:
            raise OptionError("pass tls= or backend=, not both")
        backend = TlsBackend(tls)
    max_memory = o["max_memory"]
    if max_memory is not None and max_memory < 0:
        raise OptionError(f"max_memory must be >= 0, got {max_memory}")
    raw_token = token_bytes(o["token"])
    if raw_token is not None:
        check_token(raw_token)
    peer_token = token_bytes(o.get("peer_token"))
    if peer_token is not None:
        check_token(peer_token)
    if not is_loopback(host):
        if raw_token is None and not o["insecure"]:
            raise OptionError(f"binding {host} exposes the server beyond this machine: pass a token, or insecure=True")
        if raw_token is None:
            warnings.warn(
                f"serving on {host} without a token: anyone who can reach it may write memory",
                RuntimeWarning,
                stacklevel=3,
            )
    place = Placement(device=o["device"], framework=o["framework"])  # checked as every load checks it
    host_target = check_device(place)  # fails now on a missing device, not per client
    if host_target is None:  # a CUDA device: a bare "cuda" named once, in the caller's thread
        place = Placement(device=cuda_device(place, _current_device), framework=place.framework)
    settings = {k: o[k] for k in ServerOptions.__annotations__ if k not in INPUT_ONLY}
    settings.update(
        device=place.device,
        token=raw_token,
        peer_token=peer_token if peer_token is not None else raw_token,
        max_memory=default_max_memory(place) if max_memory is None else max_memory,
        handshake_timeout=float(o["handshake_timeout"]),
        idle_timeout=None if o["idle_timeout"] is None else float(o["idle_timeout"]),
        io_timeout=None if o["io_timeout"] is None else float(o["io_timeout"]),
        backend=backend,
    )
    config = ServerConfig(host=host, port=port, naive=not env.load_opt(), slices=_slices(o), **settings)
    if config.slices is not None and (host_target is None or not host_target.memcpy_ok):
        raise OptionError("shard= is for host memory: a cpu server without a dtype cast")
    if config.reserve and (host_target is None or not host_target.memcpy_ok):
        raise OptionError("reserve is for host memory: a cpu server without a dtype cast")
    return config, host_target


def _slices(o: Mapping[str, Any]) -> Slices | None:
    shard, fused = o["shard"], o["fused"]
    if shard is None:
        if fused is not None:
            raise OptionError("fused= names the fused tensors of shard=: give shard= too")
        return None
    if not hasattr(shard, "serving"):
        raise OptionError(f"shard= takes a weightlift.Shard with rank and world, not {type(shard).__name__}")
    slices: Slices = shard.serving(fused)
    return slices
