"""The server's operator log: one key=value line per event, on the ``weightlift.server`` loggers."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest

from tests.checkpoints import write
from tests.remote.test_tls import _self_signed
from tests.waiting import wait_for
from weightlift.errors import WeightliftError
from weightlift.remote.client.client import Client
from weightlift.remote.server.server import Server
from weightlift.remote.transport import server_tls_context

TOKEN = b"log-test-token-0123456789abcdef"


def _events(caplog, event: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("weightlift.server") and f"event={event} " in r.getMessage()
    ]


def _model(tmp_path, n: int = 3, size: int = 5000) -> str:
    rng = np.random.default_rng(1)
    tensors = [(f"w.{i}", "U8", (size,), rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for i in range(n)]
    return str(write(tmp_path / "m.safetensors", tensors))


def test_a_push_logs_open_barrier_and_close_lines(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="weightlift.server")
    with Server() as s:
        with Client(s.address) as c:
            c.push(_model(tmp_path))
        wait_for(lambda: _events(caplog, "connection_close"))
    assert _events(caplog, "connection_open")[0].startswith("event=connection_open peer=127.0.0.1:")
    barriers = _events(caplog, "barrier")
    assert any("tensors=3 bytes=15000 errors=0" in b for b in barriers), barriers
    assert len(barriers) < 3  # a line per barrier, never per tensor
    assert "seconds=" in _events(caplog, "connection_close")[0]


def test_a_wrong_token_is_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="weightlift.server")
    with Server(token=TOKEN) as s:
        with pytest.raises(WeightliftError):
            Client(s.address, token=b"not-the-token-0123456789abcdef")
        wait_for(lambda: _events(caplog, "auth_failed"))
    (line,) = _events(caplog, "auth_failed")
    assert "peer=127.0.0.1:" in line and "reason=" in line


def test_a_memory_limit_refusal_names_the_limit(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="weightlift.server")
    with Server(max_memory=1 << 20) as s:
        with Client(s.address) as c, pytest.raises(WeightliftError):
            c.push(_model(tmp_path, n=2, size=700_000))
        wait_for(lambda: [b for b in _events(caplog, "barrier") if "errors=1" in b])
    line = next(b for b in _events(caplog, "barrier") if "errors=1" in b)
    assert "memory" in line.lower(), line


def test_a_plaintext_client_at_a_tls_server_is_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="weightlift.server")
    cert, key = _self_signed(tmp_path)
    with Server(tls=server_tls_context(cert, key), handshake_timeout=2) as s:
        raw = socket.create_connection(s.address, timeout=5)
        raw.sendall(b"\x00" * 300)
        try:
            raw.recv(100)
        except ConnectionResetError:
            pass
        raw.close()
        wait_for(lambda: _events(caplog, "tls_failed"))
    assert "TLS handshake" in _events(caplog, "tls_failed")[0]


def test_a_plaintext_client_at_a_tls_server_is_told_to_use_tls(tmp_path):
    cert, key = _self_signed(tmp_path)
    with Server(tls=server_tls_context(cert, key), handshake_timeout=2) as s:
        with pytest.raises(WeightliftError, match="connect with TLS"):
            Client(s.address, timeout=5)
