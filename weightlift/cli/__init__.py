"""The ``weightlift`` command: argument parsing only; every subcommand calls the library."""

from __future__ import annotations

from weightlift.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
