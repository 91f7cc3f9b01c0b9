"""Targets: host memcpy fill, cast fill in chunks, CUDA through pinned staging (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.checkpoints import raw_bytes
from tests.devices import HAS_TORCH, FakeDeviceTensor, has_cuda, needs_cuda, needs_torch
from weightlift.errors import DeviceError, OptionError
from weightlift.memory.targets import CastTarget, HostTarget, as_bytes, fresh_host, make_target

FRAMEWORKS = ["numpy", pytest.param("torch", marks=needs_torch)]


def test_fresh_host_is_writable_and_sized():
    for n in (0, 10, 3 * 2**20 + 7):
        a = fresh_host(n)
        assert a.size == n and a.flags.writeable
        a[:] = 7
        assert int(a.sum()) == 7 * n


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_host_target_memcpy(framework):
    t = make_target("cpu", framework)
    assert isinstance(t, HostTarget) and t.memcpy_ok
    dest = t.empty("BF16", (4, 3))
    src = np.arange(24, dtype=np.uint8).tobytes()
    t.host_view(dest)[:] = src
    t.write(dest, 4, b"\xff\xff")
    if framework == "numpy":
        got = dest.view(np.uint8).tobytes()
    else:
        import torch

        got = dest.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert got == src[:4] + b"\xff\xff" + src[6:]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_cast_target_streams_chunks(framework):
    t = make_target("cpu", framework, "F16")
    assert isinstance(t, CastTarget) and not t.memcpy_ok
    src = np.linspace(-3, 3, 1000, dtype=np.float32)
    dest = t.empty("F32", (10, 100))
    raw = src.tobytes()
    for off in range(0, len(raw), 400):
        t.write(dest, off, raw[off : off + 400])
    out = t.finish(dest)
    ref = src.astype(np.float16).reshape(10, 100)
    got = out if framework == "numpy" else out.numpy()
    np.testing.assert_array_equal(got, ref)
    with pytest.raises(OptionError):
        t.write(t.empty("F32", (4,)), 2, b"\x00" * 4)


@needs_torch
def test_cuda_refused_without_device():
    if has_cuda():
        pytest.skip("a CUDA device is present")
    with pytest.raises(DeviceError):
        make_target("cuda", "torch")


@needs_cuda
def test_cuda_target_double_buffered_writes():
    t = make_target("cuda", "torch")
    src = np.random.default_rng(0).integers(0, 256, 3 * 1024 * 1024 + 5, dtype=np.uint8)
    dest = t.empty("U8", (src.size,))
    t2 = type(t)("cuda", slot_bytes=1 << 20)
    for off in range(0, src.size, 700_000):
        t2.write(dest, off, src[off : off + 700_000].tobytes())
    out = t2.finish(dest)
    assert out.cpu().numpy().tobytes() == src.tobytes()


def test_populate_faults_in_without_changing_size():
    from weightlift.memory.targets import populate

    a = fresh_host(5 * 2**20 + 3)
    populate(a)
    populate(memoryview(a)[7:1000])
    populate(np.empty(0, np.uint8))
    a[:] = 9
    assert int(a[-1]) == 9 and a.size == 5 * 2**20 + 3


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_seam_on_host_targets(framework):
    """What the loader and the receiver ask a target for: a whole-load arena and views of it, a
    cast variant, and staging that lands through the target's own fill step."""
    from weightlift.formats import TensorInfo

    host = make_target("cpu", framework)
    assert not host.unified_memory
    arena = host.arena(64)
    arena[:] = np.arange(64, dtype=np.uint8)
    t = TensorInfo("w", "U8", (2, 8), "f", 0, 16)
    got = host.view(arena, 8, t)
    assert raw_bytes(got) == bytes(range(8, 24)) and tuple(got.shape) == (2, 8)
    cast = host.casting("F16")
    assert isinstance(cast, CastTarget) and cast.framework == framework and cast.dtype == "F16"
    src = np.linspace(-1, 1, 6, dtype=np.float32)
    dest = cast.empty("F32", (6,))
    spare = memoryview(bytearray(8))  # a receiver's staging buffer: 8 bytes, two floats a time
    with cast.stager(spare) as st:
        pos = 0
        while pos < src.nbytes:
            buf = st.take(src.nbytes - pos)
            assert len(buf) == min(8, src.nbytes - pos)
            buf[:] = np.frombuffer(src.tobytes()[pos : pos + len(buf)], np.uint8)
            st.land(dest, pos)
            pos += len(buf)
    out = cast.finish(dest)
    np.testing.assert_array_equal(out if framework == "numpy" else out.numpy(), src.astype(np.float16))


@needs_torch
def test_as_bytes_of_host_memory_is_a_view():
    import torch

    a = np.arange(6, dtype=np.float32)
    t = torch.arange(6, dtype=torch.bfloat16)
    assert np.shares_memory(as_bytes(a), a) and as_bytes(a).tobytes() == a.tobytes()
    assert as_bytes(t).tobytes() == t.view(torch.uint8).numpy().tobytes()
    assert as_bytes(t).ctypes.data == t.data_ptr()  # no copy


@needs_torch
def test_as_bytes_of_a_device_tensor_copies_it_to_host_after_the_writers_event():
    """A device tensor's ``.numpy()`` raises: its bytes are read through a host copy, after the
    event recorded where they were written has completed."""
    import torch

    t = torch.arange(1000, dtype=torch.float32)
    order: list[str] = []
    dev = FakeDeviceTensor(t, order)

    class Written:
        def synchronize(self) -> None:
            order.append("event")

    got = as_bytes(dev, after=Written())
    assert got.tobytes() == t.numpy().tobytes()
    assert order == ["event", "cpu"]
    assert as_bytes(dev).tobytes() == t.numpy().tobytes()


def test_a_bare_cuda_is_resolved_once_from_the_callers_current_device():
    from weightlift.memory.targets import cuda_device

    def never() -> int:
        raise AssertionError("an explicit index needs no current device")

    assert cuda_device("cuda", lambda: 1) == "cuda:1"
    assert cuda_device("cuda:3", never) == "cuda:3"
    with pytest.raises(OptionError):
        cuda_device("cpu", never)
    with pytest.raises(OptionError):
        cuda_device("cuda:x", never)


def test_a_placement_is_taken_as_the_value_it_is():
    """A checked Placement goes into the target as it is: its number read off, nothing parsed."""
    from weightlift.memory.targets import cuda_device, target_for
    from weightlift.options import Placement

    def never() -> int:
        raise AssertionError("an explicit index needs no current device")

    assert cuda_device(Placement(device="cuda", framework="torch"), lambda: 2) == "cuda:2"
    assert cuda_device(Placement(device="cuda:3", framework="torch"), never) == "cuda:3"
    with pytest.raises(OptionError, match="not a CUDA device: 'cpu'"):
        cuda_device(Placement(), never)
    for framework in ("numpy", "torch") if HAS_TORCH else ("numpy",):
        host = target_for(Placement(framework=framework))
        assert type(host) is HostTarget and host.framework == framework
        cast = target_for(Placement(framework=framework), "F16")
        assert type(cast) is CastTarget and cast.framework == framework


@needs_torch
def test_a_cuda_placement_without_a_device_is_refused_by_its_name():
    if has_cuda():
        pytest.skip("a CUDA device is present")
    from weightlift.memory.targets import target_for
    from weightlift.options import Placement

    with pytest.raises(DeviceError, match=r"^device 'cuda:1' asked for"):
        target_for(Placement(device="cuda:1", framework="torch"))


def test_empty_device_cache_frees_the_named_devices_cache_and_says_how_much():
    from weightlift.memory.targets import empty_device_cache

    calls: list[str] = []

    class Cuda:
        reserved = {"cuda:1": 5 << 20}
        current = "cuda:0"

        @classmethod
        def memory_reserved(cls, device: str) -> int:
            return cls.reserved[device]

        @classmethod
        def empty_cache(cls) -> None:
            calls.append(cls.current)
            cls.reserved[cls.current] = 1 << 20

        @classmethod
        def device(cls, device: str):
            import contextlib

            @contextlib.contextmanager
            def on():
                was, cls.current = cls.current, device
                yield
                cls.current = was

            return on()

    class Torch:
        cuda = Cuda

    assert empty_device_cache("cuda:1", torch=Torch) == 4 << 20
    assert calls == ["cuda:1"]
