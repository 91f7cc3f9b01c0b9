"""The public API: a small set of names, pinned."""

from __future__ import annotations

import weightlift


def test_all_is_pinned():
    assert sorted(weightlift.__all__) == sorted(
        [
            "load",
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
        ]
    )
    for name in weightlift.__all__:
        assert getattr(weightlift, name) is not None


def test_error_tree():
    for name in ("FormatError", "OptionError", "ProtocolError", "AuthError", "TransportError", "CacheError", "DeviceError"):
        assert issubclass(getattr(weightlift, name), weightlift.WeightliftError)
    assert issubclass(weightlift.NotFoundError, weightlift.FormatError)


def test_py_typed_shipped():
    import importlib.resources

    assert importlib.resources.files("weightlift").joinpath("py.typed").is_file()
