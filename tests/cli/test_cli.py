"""The CLI: one clear line and exit status 2 for user mistakes, JSON that scripts can read."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import weightlift.progress as progress
from tests.checkpoints import every_dtype, write
from tests.devices import needs_torch
from weightlift.cli import main


@pytest.fixture()
def ckpt(tmp_path):
    return write(tmp_path / "m.safetensors", every_dtype())


def test_inspect_table_and_json(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "t.bf16" in out and "tensors" in out
    assert main(["inspect", str(ckpt), "--json", "--select", "t.f32"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in obj["tensors"]] == ["t.f32"]
    assert obj["tensors"][0]["length"] == 60


@pytest.mark.parametrize("framework", ["numpy", pytest.param("torch", marks=needs_torch)])
def test_load_json_has_figures_and_profile(ckpt, capsys, tmp_path, framework):
    trace = tmp_path / "t.json"
    assert main(["load", str(ckpt), "--json", "--profile", "--trace", str(trace), "--framework", framework]) == 0
    obj = json.loads(capsys.readouterr().out)
    for k in ("tensors", "bytes", "seconds", "gbps", "resident_before", "profile"):
        assert k in obj
    assert obj["tensors"] == len(every_dtype())
    assert "traceEvents" in json.loads(trace.read_text())


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["load", "/nonexistent/model.safetensors"], "/nonexistent/model.safetensors: no such file"),
        (["inspect", "{bad}"], "{bad}"),
        (["load", "{ckpt}", "--framework", "jax"], "invalid choice"),
        (["load", "{ckpt}", "--device", "tpu"], "unknown device"),
        (["load", "{ckpt}", "--select", "zzz*"], "matches no tensor"),
    ],
)
def test_user_mistakes_are_one_line_exit_2(ckpt, tmp_path, argv, needle):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    argv = [a.replace("{ckpt}", str(ckpt)).replace("{bad}", str(bad)) for a in argv]
    needle = needle.replace("{bad}", str(bad))
    res = subprocess.run([sys.executable, "-m", "weightlift.cli", *argv], capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr


def test_python_dash_m_weightlift_is_the_cli(ckpt):
    res = subprocess.run(
        [sys.executable, "-m", "weightlift", "inspect", str(ckpt), "--json"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tensors"]
    res = subprocess.run(
        [sys.executable, "-m", "weightlift", "inspect", "/no/such/file"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_weightlift_alone_prints_usage_with_every_command(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: weightlift")
    for command in ("load", "inspect", "serve", "push", "pull", "ls", "bench"):
        assert command in out


def _parsers(parser, prog="weightlift"):
    """(name, parser) of the main parser and every subcommand's, at any depth."""
    import argparse

    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_option_and_argument_of_every_command_has_help():
    import argparse

    from weightlift.cli.main import build_parser

    parsers = dict(_parsers(build_parser()))
    assert {"weightlift load", "weightlift push", "weightlift check", "weightlift bench"} <= set(parsers)
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, p in parsers.items()
        for action in p._actions
        if not action.help and not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    ]
    assert missing == []
    for name, p in parsers.items():  # and each command's --help prints
        assert p.format_help().startswith(f"usage: {name}")


def test_the_cli_and_push_help_import_neither_the_server_nor_ml_dtypes():
    code = (
        "import sys\n"
        "from weightlift.cli.main import main\n"
        "try:\n"
        "    main(['push', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('weightlift.remote.server.server') or m == 'ml_dtypes'))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def _model(tmp_path):
    # 4 MiB in all: a line of "4.00 MiB / 4.00 MiB" at the end
    return write(
        tmp_path / "p.safetensors",
        [("big", "U8", (3 << 20,), b"\x01" * (3 << 20)), ("w", "F32", (1 << 18,), b"\x02" * (1 << 20))],
    )


@pytest.mark.parametrize("tty", [True, False])
def test_push_and_pull_draw_progress_on_a_terminal_only(tmp_path, monkeypatch, capsys, tty):
    from weightlift.remote.server.server import Server

    path = _model(tmp_path)
    with Server() as s:
        addr = f"{s.address[0]}:{s.address[1]}"
        err = _FakeTTY() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)  # after pytest's capture took stderr
        monkeypatch.setattr(progress, "DELAY", 0.0)
        assert main(["push", str(path), "--to", addr]) == 0
        pushed = err.getvalue()
        assert main(["pull", "--from", addr, "-o", str(tmp_path / "o.safetensors")]) == 0
        pulled = err.getvalue()[len(pushed) :]
        assert main(["push", str(path), "--to", addr, "--json"]) == 0
        assert err.getvalue() == pushed + pulled  # --json: never a line
    assert json.loads(capsys.readouterr().out.split("\n", 2)[-1])["bytes"] == 4 << 20
    if not tty:
        assert pushed == pulled == ""
        return
    for text, label in ((pushed, f"pushing to {addr}"), (pulled, f"pulling from {addr}")):
        last = text.rstrip("\n").split("\r")[-1].replace("\x1b[K", "")
        assert last.startswith(f"{label}: 100.0%  4.00 MiB / 4.00 MiB  "), text
        assert text.endswith("\n")


@needs_torch
def test_load_reports_imports_apart_from_the_load(ckpt, tmp_path):
    """In a fresh process: torch (for torch tensors) and ml_dtypes (bfloat16 into numpy) are imported
    before the load's clock, and said so."""

    def run(*argv):
        res = subprocess.run([sys.executable, "-m", "weightlift", "load", *argv], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        return res.stdout

    obj = json.loads(run(str(ckpt), "--framework", "torch", "--json"))
    assert obj["imported"] == ["torch"] and obj["import_seconds"] > 0 and "seconds" in obj
    assert run(str(ckpt), "--framework", "torch").startswith("imported torch in ")
    assert json.loads(run(str(ckpt), "--json"))["imported"] == ["ml_dtypes"]  # every_dtype has BF16
    f32 = write(tmp_path / "f32.safetensors", [("w", "F32", (4,), b"\x00" * 16)])
    assert json.loads(run(str(f32), "--json"))["imported"] == []
    assert run(str(f32)).startswith("loaded 1 tensors")
