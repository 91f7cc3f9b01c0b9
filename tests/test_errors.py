"""The error tree: each error is also the built-in a Python user would catch, and stays readable.

Code written for ``open()``, ``json`` or ``socket`` catches weightlift's errors with the built-in it
already names; weightlift's own handlers of those built-ins do not swallow ours on the way.
"""

from __future__ import annotations

import errno
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import weightlift
from tests.checkpoints import write
from weightlift.cli.main import main as cli
from weightlift.errors import (
    AuthError,
    FileError,
    NotFoundError,
    OptionError,
    TransportError,
    TransportTimeout,
    WeightliftError,
    install_hint,
    os_error,
)
from weightlift.remote.client.client import Client
from weightlift.remote.server.server import Server

TOKEN = b"errors-test-token-0123456789abcdef"


@pytest.mark.parametrize(
    "cls,builtin",
    [
        (NotFoundError, FileNotFoundError),
        (FileError, OSError),
        (OptionError, ValueError),
        (AuthError, PermissionError),
        (TransportError, ConnectionError),
        (TransportTimeout, TimeoutError),
        (TransportTimeout, TransportError),
    ],
)
def test_each_error_is_also_its_builtin(cls, builtin):
    assert issubclass(cls, WeightliftError) and issubclass(cls, builtin)


def test_the_message_constructor_and_os_fields_keep_working():
    e = NotFoundError("no such file", file="m.safetensors", tensor="w")
    assert str(e) == "m.safetensors: tensor 'w': no such file"  # not "[Errno 2] ..."
    assert (e.errno, e.filename, e.file, e.tensor, e.reason) == (
        errno.ENOENT,
        "m.safetensors",
        "m.safetensors",
        "w",
        "no such file",
    )
    f = FileError("cannot read: Input/output error", file="m.safetensors", errno=errno.EIO)
    assert str(f) == "m.safetensors: cannot read: Input/output error"
    assert (f.errno, f.strerror, f.filename) == (errno.EIO, "cannot read: Input/output error", "m.safetensors")
    assert FileError("file ended").errno is None
    assert str(OptionError("threads must be at least 1")) == "threads must be at least 1"
    assert str(AuthError("bad token")) == "bad token" and AuthError("x").errno == errno.EACCES
    assert str(TransportTimeout("late")) == "late" and TransportTimeout("x").errno == errno.ETIMEDOUT
    for err in (e, f, OptionError("o"), AuthError("a"), TransportError("t"), TransportTimeout("l")):
        back = pickle.loads(pickle.dumps(err))  # across processes (a rank's error, a child's)
        assert type(back) is type(err) and str(back) == str(err)
    missing = os_error(FileNotFoundError(errno.ENOENT, "No such file or directory"), "x.gguf", "cannot open")
    assert isinstance(missing, NotFoundError) and str(missing) == "x.gguf: no such file"


def test_except_file_not_found_catches_a_missing_checkpoint(tmp_path):
    missing = tmp_path / "model.safetensors"
    try:
        weightlift.load(missing)
    except FileNotFoundError as e:  # as for open(missing)
        assert e.filename == str(missing)
    else:
        pytest.fail("no error")


def test_except_value_error_catches_a_bad_option(tmp_path):
    path = write(tmp_path / "m.safetensors", [("w", "F32", (2,), np.ones(2, np.float32).tobytes())])
    caught = []
    for bad in ({"threads": 0}, {"device": "tpu"}, {"page_cache": "sometimes"}):
        try:
            weightlift.load(path, **bad)
        except ValueError as e:
            caught.append(str(e))
    assert len(caught) == 3 and all(caught)


def test_except_connection_error_catches_a_refused_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(ConnectionError):
        Client(f"127.0.0.1:{port}", timeout=5)


def test_except_timeout_error_catches_a_server_that_never_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # accepted by the kernel, never answered
        with pytest.raises(TimeoutError):
            Client(s.getsockname(), timeout=0.3)


def test_except_permission_error_catches_a_wrong_token():
    with Server(token=TOKEN) as srv:
        with pytest.raises(PermissionError):
            Client(srv.address, token=b"not-the-token-0123456789abcdef")


def _token_file(tmp_path, mode):
    f = tmp_path / "tok"
    f.write_bytes(TOKEN)
    os.chmod(f, mode)
    return f


def test_the_cli_says_what_it_said_before(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a token file others can read: its own message, not an OSError's or a bad path's
    loose = _token_file(tmp_path, 0o644)
    assert cli(["ls", "--from", f"127.0.0.1:{port}", "--token-file", str(loose)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weightlift: error: token file {loose} is accessible by others (mode 0644)"), err
    assert cli(["ls", "--from", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err == f"weightlift: error: cannot connect to 127.0.0.1:{port}: Connection refused\n"
    res = subprocess.run(
        [sys.executable, "-m", "weightlift", "load", str(tmp_path / "none.safetensors")], capture_output=True, text=True
    )
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1
    assert res.stderr.startswith(f"weightlift: error: {tmp_path / 'none.safetensors'}: no such file")


def test_a_file_that_ends_early_says_so_once(tmp_path):
    from weightlift.disk.source import MappedFile, _read_chunk

    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    m = MappedFile(str(path))
    try:
        with pytest.raises(FileError) as got:
            _read_chunk(m, 0, 4096, None, None, 4096)  # the file ends at byte 100
    finally:
        m.close()
    # ours, not re-wrapped by the handler of OSError around it
    assert str(got.value) == f"{path}: file ended at byte 100 while reading tensors"


def test_install_hints_work_from_a_checkout_and_name_the_index_form():
    assert (
        install_hint("s3")
        == "pip install -e '.[s3]' from a checkout of weightlift (or 'weightlift[s3]' once published)"
    )
    # every hint in the package is this one: none says only the index form, which fails until published
    pkg = Path(weightlift.__file__).parent
    only_index = [
        f"{p.relative_to(pkg)}:{i}"
        for p in sorted(pkg.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "pip install 'weightlift[" in line or 'pip install "weightlift[' in line
    ]
    assert only_index == []


def test_a_missing_extra_names_the_line_that_works_today(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "botocore", None)  # as if the s3 extra were not installed
    monkeypatch.setitem(sys.modules, "botocore.session", None)
    with pytest.raises(OptionError) as got:
        weightlift.load("s3://bucket/model.safetensors")
    assert str(got.value) == f"s3:// needs botocore and obstore: {install_hint('s3')}"
    assert isinstance(got.value, ValueError)
