"""One tensor's bytes from its store, part by part, in order, a few parts read ahead.

For senders that pass bytes on as they come (a push to a tensor server sends one WRITE per
part): :func:`pieces` keeps ``depth`` ranged reads in flight while the caller sends the part
before them, so the store's latency hides behind the send, and holds ``depth`` parts of host
memory, whatever the tensor's size. The object's version (its ETag) is the one read when the
tensor's checkpoint was opened, which the tensor carries: a URL opened again since as another
version is not read in its place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from weightlift.formats import TensorInfo
from weightlift.sources.load import plan_budget
from weightlift.sources.objects import IDENTITY, opened

__all__ = ["pieces"]


def pieces(t: TensorInfo, *, depth: int = 4) -> Iterator[tuple[int, memoryview]]:
    """``(offset in the tensor, bytes)`` for each part of ``t``, in order; each view is valid
    until the next is asked for."""
    objs = opened(t.file)
    part = plan_budget(objs, threads=None, staged=True).part
    starts = list(range(0, t.length, part))
    free = [memoryview(bytearray(part)) for _ in range(min(depth, len(starts)) + 1)]
    inflight: deque[tuple[int, memoryview, Future[None]]] = deque()
    with ThreadPoolExecutor(max(1, min(depth, len(starts))), thread_name_prefix="wl-source-piece") as ex:
        nxt = 0

        def submit() -> None:
            nonlocal nxt
            a = starts[nxt]
            buf = free.pop()[: min(part, t.length - a)]
            read = ex.submit(objs.read_into, t.file, t.offset + a, buf, identity=t.extra.get(IDENTITY))
            inflight.append((a, buf, read))
            nxt += 1

        try:
            while nxt < len(starts) and len(inflight) < depth:
                submit()
            held: memoryview | None = None
            while inflight:
                a, buf, fut = inflight.popleft()
                fut.result()
                if held is not None:
                    free.append(memoryview(held.obj))  # the caller is done with the part before
                if nxt < len(starts):
                    submit()
                held = buf
                yield a, buf
        finally:
            for _, _, fut in inflight:
                fut.cancel()
