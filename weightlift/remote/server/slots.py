"""Who may hold a connection: slots for connections still in their handshake, slots for
authenticated (READY) ones, and a cap per peer address.

A peer without the token can only ever hold handshake slots, which are few and separate from the
READY slots, so it never takes the slot a client works in. When every handshake slot is taken, a
new connection evicts the oldest one still in its handshake (as sshd's MaxStartups drops
early): a legitimate client finishes its handshake in a round trip or two, a peer holding slots
open holds them for the whole handshake timeout, so it is that peer whose slots go. The cap per
address keeps one host from holding every slot of either kind; it counts a host, not an address
string: every loopback address (127.0.0.0/8, ::1) is this machine, and one IPv6 /64 is one site
(a host picks any address in its /64), so each of those counts as one address
(:func:`address_group`).
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable

__all__ = ["Slots", "Slot", "address_group", "IPV6_GROUP_PREFIX"]

IPV6_GROUP_PREFIX = 64  # IPv6 peers in one network of this prefix length count as one address


def address_group(address: str) -> str:
    """What the cap per address counts ``address`` as: "loopback" for any loopback address
    (127.0.0.0/8, ::1, and their IPv4-mapped forms), the /64 network of an IPv6 address, else
    the address itself (IPv4, or a name that is no IP address)."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, IPV6_GROUP_PREFIX), strict=False))
    return str(ip)


class Slot:
    """One accepted connection's place: in the handshake until :meth:`ready`, then READY."""

    __slots__ = ("_slots", "address", "evict", "is_ready", "_live")

    def __init__(self, slots: Slots, address: str, evict: Callable[[], None]):
        self._slots = slots
        self.address = address  # the group it counts in (address_group)
        self.evict = evict  # ends the connection (its thread then releases the slot)
        self.is_ready = False
        self._live = True

    def ready(self) -> str | None:
        """Move to a READY slot; the reason it cannot (every READY slot is taken), or None."""
        return self._slots._ready(self)

    def release(self) -> None:
        """The connection ended; idempotent."""
        self._slots._release(self)


class Slots:
    def __init__(self, *, ready: int, handshakes: int, per_address: int):
        self.max_ready, self.max_handshakes, self.max_per_address = ready, handshakes, per_address
        self._lock = threading.Lock()
        self.n_ready = 0
        self.n_handshakes = 0
        self._per_address: dict[str, int] = {}
        self._handshaking: dict[Slot, None] = {}  # oldest first; evicted ones stay until their thread releases them
        self.evicted = 0

    def admit(self, address: str, evict: Callable[[], None]) -> Slot | str:
        """A handshake slot for a connection from ``address``, or why there is none; the oldest
        connection still in its handshake is evicted (``evict`` ends it) if that makes room."""
        victim: Slot | None = None
        group = address_group(address)
        with self._lock:
            if self.n_ready >= self.max_ready:
                return f"the server is serving its limit of {self.max_ready} connections"
            if self._per_address.get(group, 0) >= self.max_per_address:
                where = address if group == address else f"{address} (counted as {group})"
                return f"the server is serving its limit of {self.max_per_address} connections from {where}"
            if self.n_handshakes >= self.max_handshakes:
                victim = next(iter(self._handshaking), None)
                if victim is None:
                    return f"the server has {self.max_handshakes} connections in their handshake; try again"
                self._forget(victim)
                self.evicted += 1
            slot = Slot(self, group, evict)
            self.n_handshakes += 1
            self._per_address[group] = self._per_address.get(group, 0) + 1
            self._handshaking[slot] = None
        if victim is not None:
            victim.evict()
        return slot

    def _forget(self, slot: Slot) -> None:
        # the lock is held; the slot's counts go, whatever its connection still does
        slot._live = False
        self._handshaking.pop(slot, None)
        if slot.is_ready:
            self.n_ready -= 1
        else:
            self.n_handshakes -= 1
        left = self._per_address[slot.address] - 1
        if left:
            self._per_address[slot.address] = left
        else:
            del self._per_address[slot.address]

    def _ready(self, slot: Slot) -> str | None:
        with self._lock:
            if not slot._live:
                return "the connection was evicted during its handshake"
            if slot.is_ready:
                return None
            if self.n_ready >= self.max_ready:
                return f"the server is serving its limit of {self.max_ready} connections"
            self._handshaking.pop(slot, None)
            self.n_handshakes -= 1
            self.n_ready += 1
            slot.is_ready = True
        return None

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if slot._live:
                self._forget(slot)
