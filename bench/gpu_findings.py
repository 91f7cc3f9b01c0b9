"""A short repro of each CUDA finding of the review of weightlift's device paths, on one GPU.

    python bench/gpu_findings.py          (bench/gpu_check.sh runs it; about a minute)

Each check prints ``PASS name``, ``FAIL name: why`` or ``UNTESTED name: why`` (what one GPU
cannot show). Exit status 1 if any check failed, 2 without a CUDA device. Each check provokes
the failure it guards against (a kernel still queued on recycled memory, a side stream still
writing, a file whose data starts at 8 mod 16) rather than assuming it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

SLEEP_CYCLES = 400_000_000  # torch.cuda._sleep: a kernel that keeps a stream busy for ~0.2 s


def _safetensors(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))
    return path


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def check_push_to_a_cuda_server(tmp: Path) -> None:
    """A memory push (no digests sent) commits on a CUDA server; set_digest() answers."""
    import torch

    from weightlift.digest.setdigest import set_digest
    from weightlift.remote.client.client import Client
    from weightlift.remote.server.server import Server

    tensors = {f"w{i}": torch.randn(1000 + i, dtype=torch.float32) for i in range(4)}
    with Server(device="cuda", framework="torch") as s, Client(s.address) as c:
        c.push(tensors)
        got = s.tensors()
        for n, t in tensors.items():
            assert got[n].device.type == "cuda", n
            assert torch.equal(got[n].cpu(), t), n
        assert len(s.set_digest()) == 32
        import blake3

        want = set_digest({n: blake3.blake3(t.numpy().tobytes()).digest() for n, t in tensors.items()})
        assert s.set_digest() == want, "set digest differs from the pushed bytes'"


def check_device_resolved_in_the_callers_thread(tmp: Path) -> None:
    import torch

    from weightlift.memory.targets import make_target

    assert make_target("cuda", "torch").device == f"cuda:{torch.cuda.current_device()}"
    if torch.cuda.device_count() < 2:
        raise Untested("a second device: set_device(1) then a bare 'cuda' load needs two GPUs")


def check_copy_streams_wait_for_the_allocating_stream(tmp: Path) -> None:
    """Memory freed with a kernel still queued on the current stream, reused by a load's arena:
    the loaded bytes must be the file's, not the late kernel's."""
    import torch

    import weightlift as wl

    n = 64 << 20
    path = _safetensors(tmp / "ones.safetensors", {"w": np.ones(n, dtype=np.uint8)})
    for _ in range(3):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy ...
        x.fill_(7)  # ... and this kernel, queued behind, writes memory about to be freed
        del x
        out = wl.load(path, device="cuda", framework="torch")
        torch.cuda.synchronize()
        bad = int((out["w"] != 1).sum())
        assert bad == 0, f"{bad} bytes of the load were overwritten by a kernel queued before it"


def check_device_tensors_are_aligned(tmp: Path) -> None:
    """A file whose data starts at 8 mod 16 (about half of safetensors files): every device
    tensor starts on DEVICE_ALIGN, with the file's bytes."""
    import torch

    import weightlift as wl
    from weightlift.memory.targets import DEVICE_ALIGN

    for k in range(1, 40):
        path = _safetensors(
            tmp / "odd.safetensors", {"a" * k: np.arange(24, dtype=np.float32), "b": np.ones((64, 64), np.float16)}
        )
        if data_start(path) % 16 == 8:
            break
    else:
        raise AssertionError("could not make a file whose data starts at 8 mod 16")
    out = wl.load(path, device="cuda", framework="torch")
    ref = wl.load(path, framework="torch")
    for name, t in out.items():
        assert t.data_ptr() % DEVICE_ALIGN == 0, f"{name} at {t.data_ptr() % DEVICE_ALIGN} mod {DEVICE_ALIGN}"
        assert torch.equal(t.cpu(), ref[name]), name


def check_cuda_server_budget(tmp: Path) -> None:
    import torch

    from weightlift.remote.server.server import Server

    free, total = torch.cuda.mem_get_info()
    with Server(device="cuda", framework="torch") as s:
        assert s.max_memory < free, f"max_memory {s.max_memory} is not below the {free} bytes free"


def check_push_waits_for_the_callers_stream(tmp: Path) -> None:
    """A tensor written on the caller's side stream, pushed without a synchronize: the server
    gets the written bytes."""
    import torch

    from weightlift.remote.client.client import Client
    from weightlift.remote.server.server import Server

    t = torch.zeros(16 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with Server() as s, Client(s.address) as c, torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        t.fill_(3)
        c.push({"w": t})  # on the side stream: the push waits for what it queued
        got = s.tensors()["w"]
        assert (got == 3).all(), f"{int((got != 3).sum())} stale bytes pushed"


def check_trim_returns_device_memory(tmp: Path) -> None:
    import torch

    from weightlift.remote.client.client import Client
    from weightlift.remote.server.server import Server

    with Server(device="cuda", framework="torch") as s, Client(s.address) as c:
        c.push({"w": torch.ones(64 << 20, dtype=torch.uint8)})
        c.push({"w": torch.zeros(64 << 20, dtype=torch.uint8)})  # the first version is dropped
        given = s.trim()
        assert given >= 64 << 20, f"trim() gave back {given} bytes of the replaced 64 MiB tensor"


class Untested(Exception):
    pass


CHECKS: list[tuple[str, Callable[[Path], None]]] = [
    ("push_to_a_cuda_server_commits", check_push_to_a_cuda_server),
    ("device_resolved_in_the_callers_thread", check_device_resolved_in_the_callers_thread),
    ("copy_streams_wait_for_the_allocating_stream", check_copy_streams_wait_for_the_allocating_stream),
    ("device_tensors_aligned", check_device_tensors_are_aligned),
    ("cuda_server_budget_below_free_memory", check_cuda_server_budget),
    ("push_waits_for_the_callers_stream", check_push_waits_for_the_callers_stream),
    ("trim_returns_device_memory", check_trim_returns_device_memory),
]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("FAIL preflight: no CUDA device")
        return 2
    failed = 0
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        for name, check in CHECKS:
            try:
                check(Path(d))
            except Untested as e:
                print(f"UNTESTED {name}: {e}")
            except Exception as e:  # noqa: BLE001 - every check reports, then the next runs
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
                traceback.print_exc(file=sys.stderr)
            else:
                print(f"PASS {name}")
            sys.stdout.flush()
    print("UNTESTED nccl_group_load_times_landed_bytes: NCCL between two GPUs needs two GPUs")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
