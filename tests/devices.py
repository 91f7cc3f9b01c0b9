"""What this machine has: torch, a CUDA device. Tests that need one skip without it, with a reason."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

HAS_TORCH = importlib.util.find_spec("torch") is not None


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (False without torch)."""
    if not HAS_TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch (the numpy-only install skips it)")
_skip_without_cuda = pytest.mark.skipif(not has_cuda(), reason="needs CUDA")


def needs_cuda(test: F) -> F:
    """A test that runs only on a CUDA device: marked ``gpu`` (``pytest -m gpu`` collects it, and
    bench/gpu_check.sh runs exactly those) and skipped without one."""
    return pytest.mark.gpu(_skip_without_cuda(test))  # type: ignore[no-any-return]


class FakeDeviceTensor:
    """A torch tensor as it behaves on a CUDA device, for CPU tests of the code that reads one:
    ``.numpy()`` raises TypeError as it does there, ``.cpu()`` is the copy to host (counted)."""

    class _Device:
        type = "cuda"
        index = 0

        def __str__(self) -> str:
            return "cuda:0"

    device = _Device()

    def __init__(self, host: Any, copies: list[str] | None = None):
        self._host = host  # a CPU torch tensor: the bytes "on the device"
        self.copies = copies if copies is not None else []
        self.dtype, self.shape, self.nbytes = host.dtype, host.shape, host.nbytes

    def reshape(self, *shape: Any) -> FakeDeviceTensor:
        return FakeDeviceTensor(self._host.reshape(*shape), self.copies)

    def view(self, dtype: Any) -> FakeDeviceTensor:
        return FakeDeviceTensor(self._host.view(dtype), self.copies)

    def contiguous(self) -> FakeDeviceTensor:
        return self

    def numpy(self) -> Any:
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def cpu(self) -> Any:
        self.copies.append("cpu")
        return self._host.clone()
