"""``weightlift serve`` as a supervisor runs it: a ready file, key=value log lines, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.checkpoints import every_dtype, write
from tests.waiting import wait_for
from weightlift.remote.client.client import Client


def _serve(tmp_path, *extra):
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightlift", "serve", "--port", "0", "--ready-file", str(ready), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wait_for(lambda: ready.exists() and ready.read_text().endswith("\n"), 30)
    except AssertionError:
        proc.kill()
        raise
    return proc, ready, ready.read_text().strip()


def test_sigterm_is_a_clean_stop_with_status_0(tmp_path):
    proc, ready, address = _serve(tmp_path)
    path = write(tmp_path / "m.safetensors", every_dtype())
    with Client(address) as c:
        c.push(str(path))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "interrupted" not in err and "Traceback" not in err
    assert not ready.exists()  # a supervisor does not see a stopped server as ready
    lines = [ln for ln in err.splitlines() if "event=" in ln]
    assert any("event=connection_open peer=127.0.0.1:" in ln and "level=INFO" in ln for ln in lines), err
    close = [ln for ln in lines if "event=connection_close" in ln]
    assert close and "seconds=" in close[0], err
    assert any("event=stop reason=SIGTERM" in ln for ln in lines), err


def test_log_level_warning_hides_connection_lines(tmp_path):
    proc, _, address = _serve(tmp_path, "--log-level", "warning")
    path = write(tmp_path / "m.safetensors", every_dtype())
    with Client(address) as c:
        c.push(str(path))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "event=connection_open" not in err


def test_metrics_are_scraped_over_http_from_a_running_server(tmp_path):
    pytest.importorskip("prometheus_client")
    proc, _, address = _serve(tmp_path, "--metrics", "0")
    try:
        first = proc.stdout.readline()
        assert first.startswith("weightlift: metrics on http://127.0.0.1:"), first
        url = first.split(" on ", 1)[1].strip()
        path = write(tmp_path / "m.safetensors", every_dtype())
        with Client(address) as c:
            c.push(str(path))
            held = len(c.list())
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "# TYPE weightlift_server_connections_total counter" in body
    assert "# TYPE weightlift_server_memory_used gauge" in body
    assert f"weightlift_server_tensors_held {float(held)}" in body
    assert "weightlift_server_connections_total 1.0" in body


def test_a_token_file_read_in_code_matches_serve_token_file(tmp_path):
    from weightlift.remote.server.server import Server
    from weightlift.remote.token import read_token

    tok = tmp_path / "tok"
    tok.write_text("a-token-of-thirty-two-characters\n")
    tok.chmod(0o600)
    path = write(tmp_path / "m.safetensors", every_dtype())
    with Server(token=read_token(str(tok))) as s:  # as `serve --token-file tok` reads it
        with Client(s.address, token=open(tok).read()) as c:  # the README's way, newline and all
            c.push(str(path))
    with Server(token=open(tok).read()) as s, Client(s.address, token=read_token(str(tok))) as c:
        assert c.list() == []


def test_serve_peer_token_file_is_what_a_relay_presents_to_the_next_hop(tmp_path):
    from weightlift.remote.server.server import Server

    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.write_text("the-first-servers-token-0123456789\n")
    theirs.write_text("the-next-servers-token-0123456789\n")
    for f in (mine, theirs):
        f.chmod(0o600)
    path = write(tmp_path / "m.safetensors", every_dtype())
    with Server(token=theirs.read_text()) as nxt:
        proc, _, address = _serve(tmp_path, "--token-file", str(mine), "--peer-token-file", str(theirs))
        try:
            with Client(address, token=mine.read_text()) as c:
                c.push(str(path), to=["{}:{}".format(*nxt.address)], relay="chain")
            assert len(nxt.tensors()) == len(every_dtype())
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
