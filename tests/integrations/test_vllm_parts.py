"""The parts of the vLLM integration that need no vLLM: the load format's options and the pull
of a tensor server's tensors into torch tensors (the engine itself: test_vllm.py)."""

from __future__ import annotations

import numpy as np
import pytest

from weightlift import Client, OptionError, Server
from weightlift.integrations.vllm.options import KEYS, LoaderOptions

TOKEN = "a token long enough for the weightlift server 0123456789"


def test_options_default_and_given():
    assert LoaderOptions.parse(None) == LoaderOptions()
    o = LoaderOptions.parse({"verify": True, "manifest": "m.json", "prefetch": True, "threads": 2, "prefault": False})
    assert (o.verify, o.manifest, o.prefetch, o.threads, o.prefault) == (True, "m.json", True, 2, False)
    assert LoaderOptions.parse({"prefault": None}).prefault is None  # a removed option, left out or false


@pytest.mark.parametrize(
    ("extra", "strategy", "reads"),
    [
        ({}, None, False),  # vLLM's default: the load reads what is cold as it goes
        ({}, "lazy", False),
        ({}, "prefetch", True),  # vLLM's documented read ahead, asked for
        ({"prefetch": None}, "prefetch", True),
        ({"prefetch": False}, "prefetch", False),
        ({"prefetch": True}, None, True),
        ({"page_cache": "keep"}, "prefetch", True),
        ({"page_cache": "evict"}, "prefetch", False),  # the page cache competes with the destination
        ({"page_cache": "evict", "prefetch": True}, None, True),
        ({"server": "h:1"}, "prefetch", False),  # no files to read
    ],
)
def test_the_files_are_read_ahead_where_prefetch_or_vllms_strategy_asks(extra, strategy, reads):
    assert LoaderOptions.parse(extra).reads_ahead(strategy) is reads


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"prefetch_all": True}, "no option 'prefetch_all'"),
        ({"verify": "yes"}, "verify must be true or false"),
        ({"prefetch": "yes"}, "prefetch must be true or false"),
        ({"prefault": 1}, "prefault must be true or false"),
        ({"verify": None}, "verify must be true or false"),
        ({"threads": 0}, "threads must be a positive integer"),
        ({"threads": True}, "threads must be a positive integer"),
        ({"page_cache": "drop"}, "page_cache must be"),
        ({"manifest": "m.json"}, "set verify too"),
        ({"token_file": "t"}, "set server too"),
        ({"server": "h:1", "prefetch": True}, "are for the files"),
        ({"prefault": True}, "prefault was removed"),
        ({"server": "h:1", "copy": True}, "are for the files"),
        ({"server": "h:1", "timeout": 0}, "timeout must be a positive number"),
        ({"server": "h:1", "timeout": float("inf")}, "timeout must be a positive number of seconds up to"),
        ({"server": "h:1", "timeout": float("nan")}, "timeout must be a positive number .* not nan"),
        ({"server": "h:1", "timeout": 1e300}, "timeout must be a positive number"),
        ({"server": "h:1", "timeout": True}, "timeout must be a positive number"),
        ({"tls": 3}, "tls must be"),
    ],
)
def test_options_refused_naming_the_key(extra, match):
    with pytest.raises(OptionError, match=match):
        LoaderOptions.parse(extra)


def test_an_unknown_option_lists_every_known_one():
    with pytest.raises(OptionError) as info:
        LoaderOptions.parse({"nope": 1})
    assert all(k in str(info.value) for k in KEYS)


def test_token_file(tmp_path):
    """Read as the CLI's --token-file is: only its owner may read it, and a short token is refused."""
    from weightlift.errors import FileError

    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert LoaderOptions.parse({"server": "h:1", "token_file": str(f)}).token() == TOKEN.encode()
    with pytest.raises(FileError, match="cannot read token file"):
        LoaderOptions.parse({"server": "h:1", "token_file": str(tmp_path / "missing")}).token()
    f.chmod(0o644)
    with pytest.raises(OptionError, match="accessible by others"):
        LoaderOptions.parse({"server": "h:1", "token_file": str(f)}).token()
    f.write_text("short\n")
    f.chmod(0o600)
    with pytest.raises(OptionError, match="at least 16"):
        LoaderOptions.parse({"server": "h:1", "token_file": str(f)}).token()


def test_pull_tensors_gives_every_tensor_the_server_holds(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.numpy import save_file

    from weightlift.integrations.vllm.pulled import ALIGN, pull_tensors

    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bias": rng.integers(0, 100, 7).astype(np.int64),
        "c.empty": np.zeros((0, 4), np.float16),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    with Server(token=TOKEN) as server:
        server.start()
        with Client(server.address, token=TOKEN) as c:
            c.push(str(path))
        host, port = server.address
        got = pull_tensors(f"{host}:{port}", token=TOKEN.encode(), verify=True)
    assert list(got) == sorted(tensors)
    for name, want in tensors.items():
        assert isinstance(got[name], torch.Tensor)
        np.testing.assert_array_equal(got[name].numpy(), want)
        if got[name].numel():
            assert got[name].data_ptr() % ALIGN == 0


def test_timeouts_vllm_json_takes_are_refused_by_the_client():
    # vLLM parses its options as JSON with Infinity and NaN; the client's socket would raise
    # OverflowError or ValueError at connect
    import json

    extra = json.loads('{"server": "h:1", "timeout": Infinity}')
    with pytest.raises(OptionError, match="timeout"):
        LoaderOptions.parse(extra)
    for bad in (float("inf"), float("nan"), -1.0, 0, True, 1e12):
        with pytest.raises(OptionError, match="timeout must be None or a number of seconds"):
            Client("127.0.0.1:1", timeout=bad)


def test_unicode_digits_in_numeric_environment_values_are_ignored(monkeypatch):
    from weightlift import env

    for value in ("\u00b3", "\u0663"):
        monkeypatch.setenv("WEIGHTLIFT_COLD_READERS", value)
        monkeypatch.setenv("WEIGHTLIFT_FAULT_HELPERS", value)
        assert env.cold_readers() is None and env.fault_helpers() is None
    monkeypatch.setenv("WEIGHTLIFT_COLD_READERS", "3")
    assert env.cold_readers() == 3


def test_a_server_listing_more_than_memory_holds_is_refused_before_mapping():
    pytest.importorskip("torch")
    from tests.remote.test_client_timeouts import FakeServer, _serve_listing
    from weightlift.errors import DeviceError
    from weightlift.integrations.vllm.pulled import pull_tensors
    from weightlift.remote.protocol import ListEntry

    tib = 1 << 40
    entries = [ListEntry(f"t.{i:03d}", "U8", (tib,), tib) for i in range(256)]
    s = FakeServer(_serve_listing(entries))
    try:
        with pytest.raises(DeviceError, match=f"server at {s.address}: its 256 tensors take {256 * tib:,} bytes"):
            pull_tensors(s.address, timeout=10)
    finally:
        s.close()


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.29.0", True),
        ("0.30.1", True),
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.32.3", True),  # a patch release of the newest tested one
        ("0.28.5", False),
        ("0.33.0", False),
        ("1.0.0", False),
        ("0.29.0rc1.dev12", True),
        ("not a version", False),
    ],
)
def test_the_tested_vllm_releases(version, inside):
    from weightlift.integrations.vllm import compat

    assert compat.within(version, "0.29.0", "0.32.0") is inside


def test_an_untested_vllm_is_said_once_and_turns_the_internals_off(monkeypatch):
    import logging

    from weightlift.integrations.vllm import compat

    monkeypatch.setattr(compat, "_checked", None)
    monkeypatch.setattr(compat, "version", lambda: "99.0.0")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("vllm.weightlift")  # vLLM's own loggers do not propagate to caplog's
    log.addHandler(handler)
    try:
        assert compat.tested() is False
        assert compat.tp_size() is None
        assert compat.prepared_folder(object(), "org/model", None) is None  # no internal reached
        assert compat.tested() is False
    finally:
        log.removeHandler(handler)
    lines = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "vLLM 99.0.0 is outside the releases it was tested on" in lines[0]
    assert f"({compat.TESTED[0]} to {compat.TESTED[1]})" in lines[0]


def test_path_options_holding_a_nul_byte_are_option_errors(tmp_path):
    # vLLM's JSON takes "\u0000" in a string; open() then raises ValueError, outside the error tree
    import json

    from weightlift.digest.published import read_manifest
    from weightlift.integrations.vllm.pulled import tls_context

    bad = json.loads('"ca\\u0000.pem"')
    opts = LoaderOptions.parse({"server": "h:1", "token_file": bad, "tls": bad})
    with pytest.raises(OptionError, match="token file 'ca.x00.pem' is not a path"):
        opts.token()
    with pytest.raises(OptionError, match="cannot load the TLS CA file 'ca.x00.pem'"):
        tls_context(opts.tls)
    opts = LoaderOptions.parse({"verify": True, "manifest": bad})
    with pytest.raises(OptionError, match="manifest 'ca.x00.pem' is not a path"):
        read_manifest(opts.manifest)
