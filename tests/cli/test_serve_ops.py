"""``weightlift serve`` as a supervisor runs it: a ready file, key=value log lines, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

from tests.checkpoints import every_dtype, write
from tests.waiting import wait_for
from weightlift.errors import WeightliftError
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


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [sys.executable, "-m", "weightlift", *args], capture_output=True, text=True, env=env, timeout=60
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return err


def _u8(path, names, size=1000, seed=0):
    rng = np.random.default_rng(seed)
    return str(write(path, [(n, "U8", (size,), rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for n in names]))


def test_stats_and_rm_over_the_cli(tmp_path):
    proc, _, address = _serve(tmp_path)
    try:
        a = _u8(tmp_path / "a.safetensors", ["x", "y"])
        assert _cli("push", a, "--to", address, "--model", "llama-a").returncode == 0
        assert _cli("push", a, "--to", address).returncode == 0
        table = _cli("stats", address)
        assert table.returncode == 0, table.stderr
        assert "tensors_held" in table.stdout and "complete tensors held now" in table.stdout
        rows = [ln.split() for ln in table.stdout.splitlines()]
        assert ["llama-a", "2", "2,000", "ready"] in rows and ["(default)", "2", "2,000", "ready"] in rows
        js = json.loads(_cli("stats", address, "--json").stdout)
        assert js["figures"]["tensors_held"] == 4 and js["figures"]["stats_requests"] == 2
        assert js["models"] == [
            {"name": "", "tensors": 2, "bytes": 2000, "pushing": False},
            {"name": "llama-a", "tensors": 2, "bytes": 2000, "pushing": False},
        ]
        ls = _cli("ls", "--from", address, "--model", "llama-a", "--json")
        assert [e["name"] for e in json.loads(ls.stdout)] == ["x", "y"]
        one = _cli("rm", address, "--model", "llama-a", "--tensor", "y")
        assert one.returncode == 0 and "removed 1 of 1 tensors of model 'llama-a'" in one.stdout
        rm = _cli("rm", address, "--model", "llama-a")
        assert rm.returncode == 0 and "removed model 'llama-a' (1 tensors)" in rm.stdout, rm.stderr
        assert json.loads(_cli("stats", address, "--json").stdout)["figures"]["models"] == 1
        bare = _cli("rm", address)
        assert bare.returncode == 2 and "--model NAME" in bare.stderr
        assert _cli("rm", address, "--all").returncode == 0
        assert json.loads(_cli("ls", "--from", address, "--json").stdout) == []
    finally:
        _stop(proc)


def test_stats_against_an_older_server_says_it_is_not_supported(tmp_path):
    from weightlift.remote.server.server import Server

    with Server(protocol_minor=4) as s:
        out = _cli("stats", f"{s.address[0]}:{s.address[1]}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "speaks protocol 1.4, which has no stats" in out.stderr


def test_sigterm_mid_push_exits_0_and_nothing_of_the_push_was_visible(tmp_path, monkeypatch):
    from weightlift.remote.client.push import Pusher

    proc, _, address = _serve(tmp_path)
    path = _u8(tmp_path / "m.safetensors", [f"t.{i:02d}" for i in range(12)], size=100_000)
    halfway, go_on = threading.Event(), threading.Event()
    real = Pusher._send
    sent = [0]

    def send(self, *a, **kw):  # the push stalls after 6 of its 12 tensors, until the signal has landed
        if sent[0] == 6:
            halfway.set()
            go_on.wait(30)
        sent[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(Pusher, "_send", send)
    outcome: list[BaseException | None] = []

    def push() -> None:
        try:
            with Client(address) as c:
                c.push(path)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - looked at below
            outcome.append(e)

    t = threading.Thread(target=push)
    t.start()
    try:
        assert halfway.wait(30)
        with Client(address) as other:
            wait_for(lambda: other.stats()["bytes_received"] >= 6 * 100_000)  # six tensors landed
            assert other.list() == [] and other.stats()["tensors_held"] == 0  # none of them is visible
            assert other.stats().model("").pushing
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        go_on.set()
        t.join(60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "event=stop reason=SIGTERM" in err
    assert "event=push_rolled_back" in err and 'reason="server stopping"' in err, err
    (e,) = outcome
    assert isinstance(e, WeightliftError), e  # a clean error, not a crash
    assert "closed" in str(e) or "reset" in str(e) or "Broken pipe" in str(e) or "stopping" in str(e), e


def test_each_event_has_a_log_line_and_a_metric(tmp_path):
    pytest.importorskip("prometheus_client")
    proc, _, address = _serve(tmp_path, "--metrics", "0", "--max-memory", "1MiB")
    try:
        url = proc.stdout.readline().split(" on ", 1)[1].strip()
        small = _u8(tmp_path / "s.safetensors", ["a", "b"])
        big = _u8(tmp_path / "b.safetensors", [f"t.{i}" for i in range(20)], size=100_000)
        with Client(address) as c:
            c.push(small, model="m")
            with pytest.raises(WeightliftError, match="memory limit"):
                c.push(big, model="m")
            c.stats()
            assert c.remove("m") == 2
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        err = _stop(proc)
    for metric in (
        "weightlift_server_pushes_committed_total 1.0",
        "weightlift_server_pushes_refused_total 1.0",
        "weightlift_server_pushes_rolled_back_total 1.0",
        "weightlift_server_stats_requests_total 1.0",
        "weightlift_server_removes_total 1.0",
        "weightlift_server_models 0.0",
    ):
        assert metric in body, (metric, body)
    lines = [ln for ln in err.splitlines() if "event=" in ln]

    def line(event: str, having: str = "") -> str:
        found = [ln for ln in lines if f"event={event} " in ln and having in ln]
        assert found, (event, err)
        return found[0]

    assert 'model="m"' in line("push_committed") and "tensors=2" in line("push_committed")
    assert "level=WARNING" in line("push_rolled_back") and "refused=True" in line("push_rolled_back")
    assert 'reason="aborted by the client"' in line("push_rolled_back")
    assert "level=WARNING" in line("barrier", "memory limit")
    assert "level=INFO" in line("stats")
    assert 'model="m"' in line("remove") and "tensors=2" in line("remove")


def test_a_systemd_units_command_line_runs_as_written(tmp_path):
    # the ExecStart of docs/operations.md, with this machine's paths: ready file, token, metrics
    pytest.importorskip("prometheus_client")
    tok = tmp_path / "token"
    tok.write_text("a-token-of-thirty-two-characters\n")
    tok.chmod(0o600)
    proc, ready, address = _serve(
        tmp_path,
        *("--host", "127.0.0.1", "--token-file", str(tok), "--max-memory", "64GiB"),
        *("--metrics", "127.0.0.1:0", "--log-level", "info"),
    )
    try:
        url = proc.stdout.readline().split(" on ", 1)[1].strip()
        assert urllib.request.urlopen(url, timeout=10).status == 200  # the health check
        out = _cli("stats", address, "--token-file", str(tok), "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["figures"]["connections"] == 1
    finally:
        _stop(proc)
    assert not ready.exists()


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
