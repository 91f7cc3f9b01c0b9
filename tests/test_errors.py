"""The error tree: each error is also the built-in a Python user would catch, and stays readable.

Code written for ``open()``, ``json`` or ``socket`` catches weightlift's errors with the built-in it
already names; weightlift's own handlers of those built-ins do not swallow ours on the way.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import weightlift
import weightlift.errors as errors_module
from tests.checkpoints import write
from weightlift.cli.main import main as cli
from weightlift.digest.published import make_manifest, read_manifest
from weightlift.errors import (
    AuthError,
    CacheError,
    DeviceError,
    FileError,
    FormatError,
    GroupError,
    IntegrityError,
    LocalProtocolError,
    NotFoundError,
    OptionError,
    ProtocolError,
    PushError,
    RemoteProtocolError,
    StateError,
    TransportError,
    TransportTimeout,
    WeightliftError,
    install_hint,
    os_error,
)
from weightlift.remote.client.client import Client
from weightlift.remote.client.connection import Busy, Replaced
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
        (FormatError, ValueError),
        (IntegrityError, ValueError),
        (StateError, RuntimeError),
        (Busy, RuntimeError),
        (Replaced, RuntimeError),
        (DeviceError, RuntimeError),
        (GroupError, RuntimeError),
    ],
)
def test_each_error_is_also_its_builtin(cls, builtin):
    assert issubclass(cls, WeightliftError) and issubclass(cls, builtin)


@pytest.mark.parametrize(
    "cls", [ProtocolError, LocalProtocolError, RemoteProtocolError, CacheError, PushError, WeightliftError]
)
def test_the_errors_no_builtin_says_stay_apart(cls):
    # a server's refusal caught by `except ValueError`, or a cache failure by `except OSError`,
    # would be mistaken for the caller's own bad value or file
    assert not issubclass(cls, (ValueError, RuntimeError, OSError, LookupError, TypeError))


def test_a_format_error_still_reads_as_before():
    e = FormatError("header is not valid JSON", file="m.safetensors", tensor="w")
    assert str(e) == "m.safetensors: tensor 'w': header is not valid JSON"
    assert (e.file, e.tensor, e.reason) == ("m.safetensors", "w", "header is not valid JSON")
    for err in (e, IntegrityError("i"), StateError("s"), DeviceError("d"), GroupError("g"), Busy("b")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


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


def _truncated_safetensors(tmp_path):
    path = write(tmp_path / "m.safetensors", [("w", "F32", (4,), np.arange(4, dtype=np.float32).tobytes())])
    path.write_bytes(path.read_bytes()[:-4])  # the last tensor's bytes end early
    return path


def test_except_value_error_catches_a_truncated_safetensors_file(tmp_path):
    path = _truncated_safetensors(tmp_path)
    try:
        weightlift.load(path)
    except ValueError as e:  # as gguf-py's reader and json raise for a bad file
        assert isinstance(e, FormatError)
        assert str(e) == f"{path}: tensor 'w': bytes [64, 80) lie outside the data region [64, 76)"
    else:
        pytest.fail("no error")


@pytest.mark.parametrize("cut", ["magic", "header"])
def test_except_value_error_catches_a_bad_gguf_file(tmp_path, cut):
    from tests.gguf_files import write_sample

    path = tmp_path / "m.gguf"
    write_sample(path)
    raw = path.read_bytes()
    path.write_bytes(b"XXXX" + raw[4:] if cut == "magic" else raw[:30])
    try:
        weightlift.load(path)
    except ValueError as e:
        assert isinstance(e, FormatError) and e.file == str(path)
    else:
        pytest.fail("no error")


def test_except_value_error_catches_bytes_that_differ_from_the_manifest(tmp_path):
    path = write(tmp_path / "m.safetensors", [("w", "U8", (64,), bytes(range(64)))])
    (tmp_path / "pub.json").write_text(make_manifest(path).to_json())
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # the file changed after the manifest was published
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError) as got:
        weightlift.load(path, verify=True, manifest=str(tmp_path / "pub.json"))
    assert isinstance(got.value, IntegrityError)


def test_a_manifest_check_is_not_rewrapped_as_malformed(tmp_path):
    path = write(tmp_path / "m.safetensors", [("w", "U8", (4,), bytes(4))])
    doc = json.loads(make_manifest(path).to_json())
    doc["version"] = 99
    bad = tmp_path / "v99.json"
    bad.write_text(json.dumps(doc))
    # the check's own message, not "malformed manifest (IntegrityError: ...)" from the ValueError handler
    with pytest.raises(IntegrityError) as got:
        read_manifest(bad)
    assert str(got.value) == f"{bad}: not a weightlift-manifest version 1"
    doc["version"], doc["digest"] = 1, "00" * 32
    bad.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError) as got:
        read_manifest(bad)
    assert str(got.value) == f"{bad}: the manifest's own digest does not match its tensors (edited or damaged)"


def test_except_runtime_error_catches_a_closed_client():
    with Server() as srv:
        client = Client(srv.address)
        client.close()
        try:
            client.list()
        except RuntimeError as e:  # as threading and concurrent.futures raise for a call their state forbids
            assert isinstance(e, StateError) and str(e) == "the client is closed"
        else:
            pytest.fail("no error")


def test_the_cli_says_what_it_said_before_for_a_bad_file(tmp_path, capsys):
    path = _truncated_safetensors(tmp_path)
    res = subprocess.run([sys.executable, "-m", "weightlift", "load", str(path)], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr == f"weightlift: error: {path}: tensor 'w': bytes [64, 80) lie outside the data region [64, 76)\n"
    # a verify that finds other bytes: exit 1, as before, not the exit 2 of other errors
    good = write(tmp_path / "g.safetensors", [("w", "U8", (64,), bytes(range(64)))])
    (tmp_path / "pub.json").write_text(make_manifest(good).to_json())
    good.write_bytes(good.read_bytes()[:-1] + b"\xff")
    assert cli(["load", str(good), "--verify", "--manifest", str(tmp_path / "pub.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("weightlift: ") and not err.startswith("weightlift: error:") and len(err.splitlines()) == 1


NO_TORCH = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
from weightlift.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_torch_load_without_torch_says_how_to_install_it(tmp_path, monkeypatch):
    path = write(tmp_path / "m.safetensors", [("w", "F32", (2,), np.ones(2, np.float32).tobytes())])
    res = subprocess.run(
        [sys.executable, "-c", NO_TORCH, "load", "--framework", "torch", str(path)], capture_output=True, text=True
    )
    assert res.returncode == 2
    assert res.stderr == f"weightlift: error: framework='torch' needs torch: {install_hint('torch')}\n"
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(OptionError, match="framework='torch' needs torch"):
        weightlift.load(path, framework="torch")


def _shadowed_handlers(source: str, namespace: dict, unresolved: list[str]) -> list[str]:
    """Handlers of a try that an earlier handler of the same try already catches (never reached);
    ``unresolved`` gets the names ``namespace`` (with the error tree's) does not hold."""
    import ast
    import builtins

    namespace = {**vars(errors_module), **namespace}
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Try):
            continue
        earlier: list[type] = []
        for h in node.handlers:
            if h.type is None:
                continue
            names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
            classes = []
            for n in names:
                try:
                    classes.append(eval(ast.unparse(n), dict(namespace), vars(builtins)))
                except (AttributeError, NameError):  # imported inside a function only
                    unresolved.append(f"line {h.lineno}: {ast.unparse(n)}")
            out += [
                f"line {h.lineno}: {c.__name__} after {e.__name__}"
                for c in classes
                for e in earlier
                if issubclass(c, e)
            ]
            earlier += classes
    return out


def test_no_except_in_the_package_is_shadowed_by_an_earlier_one():
    # a built-in base added to an error must not put it under a handler above its own
    import importlib

    assert _shadowed_handlers("try:\n    pass\nexcept ValueError:\n    pass\nexcept FormatError:\n    pass\n", {}, [])
    pkg = Path(weightlift.__file__).parent
    found: list[str] = []
    unresolved: list[str] = []
    for path in sorted(pkg.rglob("*.py")):
        source = path.read_text()
        if source.count("except ") < 2:
            continue
        name = ".".join(path.relative_to(pkg.parent).with_suffix("").parts).removesuffix(".__init__")
        try:
            module = vars(importlib.import_module(name))
        except ImportError:  # an integration whose host package is not installed: the tree's names only
            module = {}
        found += [f"{name}: {s}" for s in _shadowed_handlers(source, module, unresolved)]
    assert found == []
