"""What this machine has: torch, a CUDA device. Tests that need one skip without it, with a reason."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None


def has_cuda() -> bool:
    """Whether torch sees a CUDA device (False without torch)."""
    if not HAS_TORCH:
        return False
    import torch

    return bool(torch.cuda.is_available())


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch (the numpy-only install skips it)")
needs_cuda = pytest.mark.skipif(not has_cuda(), reason="needs CUDA")
