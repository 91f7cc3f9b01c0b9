"""Who may hold the server's connections, and for how long: handshake slots apart from READY ones,
eviction of the oldest handshake, a cap per address, idle and I/O timeouts; and a peer's
fragmentation does not multiply the server's CPU cost."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.remote.rawclient import Raw, _barrier, _put, _serves, _stalled_reader
from tests.waiting import wait_for
from weightlift.remote.protocol import (
    Alloc,
    BarrierReply,
    Bye,
    Error,
    ErrorCode,
    Free,
    FreeReply,
    Have,
    HaveReply,
    Read,
    WriteHeader,
    send,
)
from weightlift.remote.server.server import Server

TOKEN = b"0123456789abcdef-token"


def test_unauthenticated_peers_never_lock_out_an_authenticated_client():
    with Server(token=TOKEN, max_connections=2, max_handshakes=4, handshake_timeout=60) as s:
        working = Raw.connected(s.address, token=TOKEN)
        squatters = [socket.create_connection(s.address) for _ in range(30)]  # no HELLO, ever
        late = Raw.connected(s.address, token=TOKEN)  # a client arriving while every handshake slot is held
        for raw in (working, late):
            _put(raw, 0, "w", np.ones(4, dtype=np.float32))
            assert _barrier(raw).tensors == 1
        assert s.stats().evicted >= 30 - 4 + 1
        for q in squatters:
            q.close()
        working.close()
        late.close()


def test_connections_from_one_address_are_capped():
    with Server(max_per_address=3) as s:
        held = [Raw(s.address) for _ in range(3)]
        for r in held:
            r.hello()
        extra = Raw(s.address)
        reply = extra.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.LIMIT and "127.0.0.1" in reply.message
        held[0].send(Bye())
        assert held[0].closed()
        wait_for(lambda: s.stats().ready == 2)
        again = Raw.connected(s.address)
        for r in held[1:] + [again, extra]:
            r.close()


def test_an_idle_connection_is_closed():
    with Server(idle_timeout=0.2) as s:
        raw = Raw.connected(s.address)
        assert raw.closed()  # the server closed it (the socket's own timeout is 10 s)
        wait_for(lambda: s.stats().ready == 0)


def test_a_connection_stalled_inside_a_frame_is_closed():
    with Server(io_timeout=0.2, idle_timeout=None) as s:
        raw = Raw.connected(s.address)
        raw.sock.sendall(send(Free(("w",)))[:-1])  # all but its last byte
        assert raw.closed()


def test_a_reader_that_stops_reading_is_closed_and_its_memory_goes_back():
    big = 16 << 20
    with Server(io_timeout=0.3) as s:
        raw = Raw.connected(s.address)
        _put(raw, 0, "w", np.ones(big, dtype=np.uint8), dtype="U8")
        assert _barrier(raw).tensors == 1
        stalled = _stalled_reader(s.address, "w", big)
        raw.send(Free(("w",)))
        assert raw.recv() == FreeReply(1)
        wait_for(lambda: s.memory_used == 0)  # the send timed out: the reply's hold on it went
        stalled.close()
        raw.close()


_SERVE = """
import sys
from weightlift.remote.server.server import Server
s = Server()
print(s.bind()[1], flush=True)
s.serve_forever()
"""


def _cpu_seconds(pid: int) -> float:
    """The process's user CPU time: what the server's own code spends. The kernel's work per TCP
    segment (a peer sending one byte per segment makes hundreds of thousands) is charged to
    whichever process the softirq interrupts, the server's on some runs and not on others; it
    is the network stack's, the same for any TCP server, and made this test flaky."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads a process's CPU time from /proc")
def test_a_trickled_frame_costs_the_server_about_what_a_whole_one_does():
    # A HAVE of 4096 digests (128 KiB), sent whole, then one byte per send.
    frame = send(Have(tuple(i.to_bytes(32, "little") for i in range(4096))))
    proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        raw = Raw.connected(("127.0.0.1", port))
        raw.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def cost(step: int, rounds: int = 3) -> float:
            t0 = _cpu_seconds(proc.pid)
            for _ in range(rounds):
                for pos in range(0, len(frame), step):
                    raw.sock.sendall(frame[pos : pos + step])
                assert isinstance(raw.recv(), HaveReply)
            return _cpu_seconds(proc.pid) - t0

        cost(len(frame), rounds=1)  # warm-up
        whole = cost(len(frame))
        trickled = cost(1)
        assert trickled <= 4 * max(whole, 0.05), (whole, trickled)
        # a payload trickled a byte at a time lands whole
        payload = np.arange(1 << 16, dtype=np.uint8)
        raw.send(Alloc(0, "w", "U8", payload.shape, payload.nbytes))
        data = send(WriteHeader(0, 0, payload.nbytes)) + payload.tobytes()
        for pos in range(len(data)):
            raw.sock.sendall(data[pos : pos + 1])
        assert _barrier(raw) == BarrierReply(1, payload.nbytes)
        raw.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_hello_tells_an_unauthenticated_peer_nothing_of_the_limits():
    with Server(token=TOKEN, max_memory=123 << 20) as s:
        assert Raw(s.address).hello().max_memory == 0


def test_loose_or_short_tokens_are_refused(tmp_path):
    from weightlift.errors import OptionError
    from weightlift.remote.token import read_token

    f = tmp_path / "token"
    f.write_text("a-token-long-enough-to-use\n")
    f.chmod(0o644)
    with pytest.raises(OptionError, match="chmod 600"):
        read_token(str(f))
    f.chmod(0o600)
    assert read_token(str(f)) == b"a-token-long-enough-to-use"
    f.write_text("x\n")
    with pytest.raises(OptionError, match="at least 16"):
        read_token(str(f))
    with pytest.raises(OptionError, match="at least 16"):
        Server(token=b"x")


def test_a_tensor_may_not_be_named_metadata():
    from weightlift.remote.protocol import Alloc

    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "__metadata__", "U8", (0,), 0))
        reply = _barrier(raw)
        assert reply.tensors == 0 and "metadata" in reply.errors[0]
        assert s.tensors() == {}
        raw.close()


def test_ls_shows_names_safely(capsys):
    from weightlift.cli import main as cli_main
    from weightlift.remote.protocol import Alloc

    with Server() as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "evil\x1b]0;owned\x07\x1b[2J\\", "U8", (0,), 0))
        assert _barrier(raw).tensors == 1
        host, port = s.address
        assert cli_main(["ls", "--from", f"{host}:{port}"]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out
        assert "evil\\x1b]0;owned\\x07\\x1b[2J\\\\" in out
        raw.close()


_SERVE_FEW_FDS = """
import resource, sys
from weightlift.remote.server.server import Server
s = Server(max_handshakes=200, max_per_address=200, max_connections=200)
port = s.bind()[1]
import os
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(port, flush=True)
s.serve_forever()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_out_of_descriptors_a_client_is_told_and_the_log_says_why():
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE_FEW_FDS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    held = []
    try:
        assert proc.stdout is not None and proc.stderr is not None
        port = int(proc.stdout.readline())
        refused = None
        for _ in range(40):
            raw = Raw(("127.0.0.1", port))
            held.append(raw)
            if not select.select([raw.sock], [], [], 0.5)[0]:  # not refused at once: a handshake
                raw.hello()
                continue
            reply = raw.recv()
            if isinstance(reply, Error):
                refused = reply
                break
        assert refused is not None and "file descriptors" in refused.message
    finally:
        for r in held:
            r.close()
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "out of file descriptors" in err


def test_every_loopback_address_counts_as_one_address():
    # 127.0.0.0/8 is all this machine: a second loopback address is no second host
    with Server(max_per_address=2) as s:
        held = [Raw(s.address, source="127.0.0.1"), Raw(s.address, source="127.0.0.2")]
        for r in held:
            r.hello()
        extra = Raw(s.address, source="127.0.0.3")
        reply = extra.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.LIMIT, reply
        assert "127.0.0.3" in reply.message and "loopback" in reply.message
        for r in held + [extra]:
            r.close()


def test_ipv6_peers_in_one_64_count_as_one_address():
    from weightlift.remote.server.admission import Slot, Slots, address_group

    assert address_group("2001:db8:1:2::1") == address_group("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_group("2001:db8:1:3::1") != address_group("2001:db8:1:2::1")
    assert address_group("::1") == address_group("127.0.0.1") == address_group("::ffff:127.9.9.9") == "loopback"
    assert address_group("192.0.2.7") == "192.0.2.7" and address_group("localhost") == "localhost"
    slots = Slots(ready=8, handshakes=8, per_address=2)
    first = slots.admit("2001:db8:1:2::1", lambda: None)
    second = slots.admit("2001:db8:1:2::2", lambda: None)
    assert isinstance(first, Slot) and isinstance(second, Slot)
    refused = slots.admit("2001:db8:1:2:abcd::3", lambda: None)
    assert isinstance(refused, str) and "2001:db8:1:2::/64" in refused
    assert isinstance(slots.admit("2001:db8:1:3::1", lambda: None), Slot)  # another /64
    first.release()
    assert isinstance(slots.admit("2001:db8:1:2::4", lambda: None), Slot)


def _trickle_until_closed(raw: Raw, data: bytes, every: float) -> int:
    """Send ``data`` a byte at a time, ``every`` seconds apart; how many bytes went before the
    server closed the connection (len(data) if it never did)."""
    raw.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(len(data)):
        if select.select([raw.sock], [], [], every)[0]:  # the server's end is closed (or it replied)
            return i
        try:
            raw.sock.sendall(data[i : i + 1])
        except OSError:
            return i
    return len(data)


def test_a_frame_trickled_inside_the_io_timeout_is_cut_by_its_deadline():
    # One byte every 0.2 s never waits out a 0.5 s I/O timeout, but the whole HAVE (about 350
    # bytes) gets 0.5 s plus its size over the minimum rate: it is cut after a few bytes.
    frame = send(Have(tuple(i.to_bytes(32, "little") for i in range(10))))
    with Server(io_timeout=0.5, idle_timeout=None) as s:
        raw = Raw.connected(s.address)
        sent = _trickle_until_closed(raw, frame[:40], 0.2)
        assert sent < 10, f"the server still read a frame trickled for {sent * 0.2:.1f} s"
        raw.close()
        wait_for(lambda: s.memory_used == 0)


def test_a_payload_trickled_inside_the_io_timeout_is_cut_by_its_deadline():
    with Server(io_timeout=0.5, idle_timeout=None) as s:
        raw = Raw.connected(s.address)
        raw.send(Alloc(0, "w", "U8", (4096,), 4096))
        raw.sock.sendall(send(WriteHeader(0, 0, 4096)))
        sent = _trickle_until_closed(raw, bytes(40), 0.2)
        assert sent < 10, f"the server still read a payload trickled for {sent * 0.2:.1f} s"
        raw.close()
        wait_for(lambda: s.memory_used == 0)  # the tensor in flight was dropped


def test_a_slow_but_steady_frame_within_the_rate_arrives():
    # 64 KiB at 1 KiB per 10 ms: every receive inside the I/O timeout, the whole within
    # io_timeout + size / min_frame_rate
    with Server(io_timeout=1.0, min_frame_rate=16 * 1024) as s:
        raw = Raw.connected(s.address)
        payload = np.arange(1 << 16, dtype=np.uint8)
        raw.send(Alloc(0, "w", "U8", payload.shape, payload.nbytes))
        data = send(WriteHeader(0, 0, payload.nbytes)) + payload.tobytes()
        for pos in range(0, len(data), 1024):
            raw.sock.sendall(data[pos : pos + 1024])
            time.sleep(0.01)
        assert _barrier(raw) == BarrierReply(1, payload.nbytes)
        raw.close()


def test_frame_rate_option_is_checked():
    from weightlift.errors import OptionError

    with pytest.raises(OptionError, match="min_frame_rate"):
        Server(min_frame_rate=0)


def test_without_a_minimum_rate_only_the_io_timeout_bounds_a_frame():
    frame = send(Have(tuple(i.to_bytes(32, "little") for i in range(10))))
    with Server(io_timeout=0.5, idle_timeout=None, min_frame_rate=None) as s:
        raw = Raw.connected(s.address)
        assert _trickle_until_closed(raw, frame[:12], 0.2) == 12  # 2.4 s, each byte inside the timeout
        raw.sock.sendall(frame[12:])
        assert isinstance(raw.recv(), HaveReply)
        raw.close()


def test_a_reply_drained_inside_the_io_timeout_is_cut_by_its_deadline():
    # the other direction: a peer that takes a large READ reply slowly, each send inside the I/O
    # timeout, must not hold its connection longer than io_timeout + size / min_frame_rate
    with Server(io_timeout=0.5, idle_timeout=None, min_frame_rate=64 << 20) as s:
        raw = Raw.connected(s.address)
        a = np.zeros(64 << 20, dtype=np.uint8)  # its reply's deadline: 0.5 s + 1 s
        _put(raw, 0, "big", a, dtype="U8")
        assert _barrier(raw).tensors == 1
        slow = socket.create_connection(s.address)
        reader = Raw.over(slow)
        reader.hello()
        reader.send(Read("big", 0, a.nbytes))
        buf = bytearray(1 << 20)
        got, t0 = 0, time.monotonic()
        while got <= a.nbytes and time.monotonic() - t0 < 30:
            try:
                n = slow.recv_into(buf)
            except OSError:
                break
            if n == 0:
                break
            got += n
            time.sleep(0.05)  # at most 20 MiB/s, each send still within the I/O timeout: 3.2 s
        assert got < a.nbytes, f"the whole reply went out over {time.monotonic() - t0:.1f} s"
        wait_for(lambda: s.stats().ready == 1)
        slow.close()
        _serves(s)  # the server goes on serving others
        raw.close()
