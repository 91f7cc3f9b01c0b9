"""The public API: a small set of names, pinned."""

from __future__ import annotations

import weightlift


def test_all_is_pinned():
    assert sorted(weightlift.__all__) == sorted(
        [
            "load",
            "prefetch",
            "Prefetch",
            "open",
            "Checkpoint",
            "TensorInfo",
            "Shard",
            "Server",
            "Client",
            "WeightliftError",
            "FormatError",
            "NotFoundError",
            "OptionError",
            "ProtocolError",
            "AuthError",
            "TransportError",
            "CacheError",
            "DeviceError",
            "FileError",
            "StateError",
            "IntegrityError",
            "GroupError",
            "PushError",
        ]
    )
    for name in weightlift.__all__:
        assert getattr(weightlift, name) is not None


def test_error_tree():
    for name in (
        "FormatError",
        "NotFoundError",
        "FileError",
        "OptionError",
        "StateError",
        "IntegrityError",
        "ProtocolError",
        "AuthError",
        "TransportError",
        "CacheError",
        "DeviceError",
        "GroupError",
        "PushError",
    ):
        assert issubclass(getattr(weightlift, name), weightlift.WeightliftError)
    # a server's "no such tensor" or a missing shard says nothing about whether a file is well formed
    assert not issubclass(weightlift.NotFoundError, weightlift.FormatError)
    assert weightlift.PushError is weightlift.distributed.PushError


def test_error_tree_is_drawn():
    """Every class of weightlift.errors appears in the tree drawn in its docstring."""
    import inspect

    import weightlift.errors as errors

    for name, cls in vars(errors).items():
        public = not name.startswith("_")
        if public and inspect.isclass(cls) and issubclass(cls, Exception) and cls.__module__ == errors.__name__:
            assert f" {name}\n" in errors.__doc__ or f" {name} " in errors.__doc__, name


def test_os_errors_map_at_the_boundary(tmp_path):
    import errno

    from weightlift.errors import os_error

    missing = os_error(FileNotFoundError(errno.ENOENT, "No such file or directory"), tmp_path / "x", "cannot open")
    assert isinstance(missing, weightlift.NotFoundError) and str(tmp_path / "x") in str(missing)
    denied = os_error(PermissionError(errno.EACCES, "Permission denied"), tmp_path / "y", "cannot open")
    assert isinstance(denied, weightlift.FileError) and denied.errno == errno.EACCES
    assert str(denied) == f"{tmp_path / 'y'}: cannot open: Permission denied"


def test_py_typed_shipped():
    import importlib.resources

    assert importlib.resources.files("weightlift").joinpath("py.typed").is_file()
