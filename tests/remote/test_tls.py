"""TLS between client and server (Python's ssl): every byte moves, sends fall back from sendfile
and scatter-gather to plain sends, and a client refuses a server its CA does not vouch for."""

from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoints import write
from weightlift.cli.main import main as cli
from weightlift.errors import TransportError
from weightlift.remote.client.client import Client
from weightlift.remote.server.server import Server
from weightlift.remote.transport import TlsStream, client_tls_context, server_tls_context

TOKEN = b"tls-test-token-0123456789abcdef"


def _self_signed(folder: Path, name: str = "localhost") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (PEM files)."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("needs the cryptography package or openssl to make a certificate")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
            + ["-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}"]
            + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True,
            capture_output=True,
        )
        return cert, key
    k = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    c = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(k.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(k, hashes.SHA256())
    )
    cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    return _self_signed(folder), _self_signed(folder, "other")


def _model(tmp_path) -> tuple[str, dict[str, bytes]]:
    rng = np.random.default_rng(4)
    tensors = {f"w.{i}": rng.integers(0, 256, 7000 * (i + 1), dtype=np.uint8).tobytes() for i in range(3)}
    tensors["big"] = rng.integers(0, 256, (2 << 20) + 17, dtype=np.uint8).tobytes()  # the sendfile path
    tensors["empty"] = b""
    path = write(tmp_path / "m.safetensors", [(n, "U8", (len(b),), b) for n, b in tensors.items()])
    return str(path), tensors


def _holds(server: Server, tensors: dict[str, bytes]) -> None:
    got = server.tensors()
    assert {n: got[n].tobytes() for n in got} == tensors


@pytest.mark.parametrize("token", [None, TOKEN])
def test_push_and_pull_over_tls(tmp_path, pki, token):
    (cert, key), _ = pki
    path, tensors = _model(tmp_path)
    with Server(tls=server_tls_context(cert, key), token=token, cache_dir=tmp_path / "c") as s:
        with Client(s.address, tls=client_tls_context(cert), token=token, streams=2) as c:
            assert all(isinstance(conn.stream, TlsStream) for conn in c.connections)
            assert all(conn.protected == (token is not None) for conn in c.connections)  # MACs inside TLS too
            assert c.push(path, verify=True, hash_threshold=100_000).verified == len(tensors)
            _holds(s, tensors)
            c.pull(tmp_path / "out.safetensors", verify=True)
    from weightlift import load

    got = load(tmp_path / "out.safetensors")
    assert {n: np.asarray(a).tobytes() for n, a in got.items()} == tensors


def test_a_client_refuses_a_server_its_ca_does_not_vouch_for(tmp_path, pki):
    (cert, key), (other, _) = pki
    with Server(tls=server_tls_context(cert, key)) as s:
        with pytest.raises(TransportError, match="TLS handshake"):
            Client(s.address, tls=client_tls_context(other))
        with pytest.raises(TransportError, match="TLS handshake"):
            Client(s.address, tls=client_tls_context())  # the system's roots do not know it either
        with Client(s.address, tls=client_tls_context(cert)) as c:  # the server lives on
            assert c.list() == []


def test_a_plain_client_gets_nowhere_with_a_tls_server_and_the_server_lives_on(tmp_path, pki):
    (cert, key), _ = pki
    with Server(tls=server_tls_context(cert, key), handshake_timeout=2) as s:
        with pytest.raises(TransportError):
            Client(s.address, timeout=5)
        raw = socket.create_connection(s.address, timeout=5)
        raw.sendall(b"\x00" * 300)  # not a TLS record: the handshake fails in that connection only
        try:
            assert raw.recv(100) == b""  # closed (or reset, below)
        except ConnectionResetError:
            pass
        raw.close()
        with Client(s.address, tls=client_tls_context(cert)) as c:
            assert c.list() == []


def test_cli_tls_options(tmp_path, pki, capsys):
    (cert, key), _ = pki
    path, tensors = _model(tmp_path)
    with Server(tls=server_tls_context(cert, key)) as s:
        addr = f"{s.address[0]}:{s.address[1]}"
        assert cli(["push", path, "--to", addr, "--tls-ca", str(cert), "--verify"]) == 0
        assert cli(["ls", "--from", addr, "--tls", "--tls-ca", str(cert), "--json"]) == 0
        assert '"big"' in capsys.readouterr().out
        assert cli(["pull", "--from", addr, "--tls-ca", str(cert), "-o", str(tmp_path / "o.safetensors")]) == 0
        assert cli(["ls", "--from", addr, "--tls"]) == 2  # the system's roots: refused
        assert "TLS handshake" in capsys.readouterr().err
        _holds(s, tensors)
    assert cli(["serve", "--port", "0", "--tls-cert", str(cert)]) == 2
    assert "--tls-cert and --tls-key" in capsys.readouterr().err


def test_every_client_command_speaks_tls(tmp_path, pki, capsys):
    """push, pull and ls above; here load --remote and check --from, each refused without TLS."""
    (cert, key), _ = pki
    path, tensors = _model(tmp_path)
    with Server(tls=server_tls_context(cert, key)) as s:
        addr = f"{s.address[0]}:{s.address[1]}"
        assert cli(["load", path, "--remote", f"{addr}=big", "--tls-ca", str(cert), "--json"]) == 0
        assert set(json.loads(capsys.readouterr().out)["remote"]) == {addr}
        _holds(s, {"big": tensors["big"]})
        assert cli(["load", path, "--remote", f"{addr}=w.*"]) == 2  # plain TCP to a TLS server
        assert "connect with TLS (--tls or --tls-ca" in capsys.readouterr().err
        assert cli(["load", path, "--remote", f"{addr}=w.*", "--tls"]) == 2  # the system's roots: refused
        assert "TLS handshake" in capsys.readouterr().err


def test_stats_and_rm_speak_tls(tmp_path, pki, capsys):
    (cert, key), _ = pki
    path, _ = _model(tmp_path)
    with Server(tls=server_tls_context(cert, key)) as s:
        addr = f"{s.address[0]}:{s.address[1]}"
        assert cli(["push", path, "--to", addr, "--tls-ca", str(cert), "--model", "m"]) == 0
        capsys.readouterr()
        assert cli(["stats", addr, "--tls-ca", str(cert), "--json"]) == 0
        assert [m["name"] for m in json.loads(capsys.readouterr().out)["models"]] == ["m"]
        assert cli(["stats", addr]) == 2  # plain TCP to a TLS server
        assert "connect with TLS (--tls or --tls-ca" in capsys.readouterr().err
        assert cli(["rm", addr, "--model", "m", "--tls-ca", str(cert)]) == 0
        assert s.tensors(model="m") == {}


def test_check_from_a_tls_server(tmp_path, pki, capsys):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    (cert, key), _ = pki
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with Server(tls=server_tls_context(cert, key)) as s:
        addr = f"{s.address[0]}:{s.address[1]}"
        with Client(s.address, tls=client_tls_context(cert)) as c:
            c.push(tmp_path / "llama")
        argv = ["check", str(tmp_path / "llama"), "--from", addr, "--tokens", "2", "--seeds", "1"]
        assert cli([*argv, "--tls-ca", str(cert), "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["ok"] and r["source"] == addr
        assert cli(argv) == 2
        assert "connect with TLS" in capsys.readouterr().err
