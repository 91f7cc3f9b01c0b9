"""Load plans: runs of back-to-back tensors, their arena layout, and chunks."""

from __future__ import annotations

from weightlift.formats import TensorInfo
from weightlift.plan import ALIGN, layout, make_chunks, make_runs


def T(name, off, n, dtype="U8", file="f"):
    return TensorInfo(name, dtype, (n,), file, off, n)


def test_back_to_back_coalesce_and_gaps_break():
    ts = [T("a", 100, 10), T("b", 110, 20), T("c", 130 + 32, 8), T("d", 10_000, 4)]
    runs = make_runs(ts)
    assert [[t.name for t in r.tensors] for r in runs] == [["a", "b", "c"], ["d"]]
    assert (runs[0].offset, runs[0].length) == (100, 70)


def test_kinds_and_files_never_mix():
    ts = [T("a", 0, 4), T("b", 4, 4, file="g"), T("c", 4, 4)]
    runs = make_runs(ts)
    assert [(r.file, [t.name for t in r.tensors]) for r in runs] == [("f", ["a", "c"]), ("g", ["b"])]
    ts = [T("a", 0, 4), T("b", 4, 4), T("c", 8, 4)]
    assert len(make_runs(ts, kind=lambda t: t.name == "b")) == 3
    assert len(make_runs(ts, coalesce=False)) == 3


def test_layout_keeps_file_alignment():
    ts = [T("a", 8, 16, "F64"), T("b", 1000 + 4, 8, "F32"), T("odd", 5001, 8, "F64")]
    runs = make_runs(ts)
    starts, total = layout(runs)
    for r, s in zip(runs, starts, strict=False):
        for t in r.tensors:
            a = s + t.offset - r.offset
            if t.name == "odd":
                assert a % ALIGN == 0  # misaligned in the file, aligned in memory
            else:
                assert a % ALIGN == t.offset % ALIGN
    assert total >= sum(r.length for r in runs)
    assert all(s2 >= s1 + r.length for (s1, r), s2 in zip(zip(starts, runs, strict=False), starts[1:], strict=False))


def test_chunks_cover_runs_exactly():
    runs = make_runs([T("a", 0, 100), T("b", 500, 7)])
    chunks = make_chunks(runs, chunk=30)
    assert [(c.run, c.start, c.length) for c in chunks] == [
        (0, 0, 30),
        (0, 30, 30),
        (0, 60, 30),
        (0, 90, 10),
        (1, 0, 7),
    ]


def test_a_device_layout_starts_every_tensor_on_its_alignment():
    """safetensors packs at 8 bytes: data starting at 8 mod 16 puts every tensor of a mirrored
    layout at 8 mod 16. A device layout starts each on ``align``, and keeps runs where it can."""
    base = 8 + 128  # the header's end: 8 mod 16
    sizes = [("a", 4096), ("b", 4096), ("c", 24), ("d", 8192), ("e", 8)]
    ts, off = [], base
    for name, n in sizes:
        ts.append(T(name, off, n, "F32" if n % 4 == 0 else "U8"))
        off += n
    mirrored = layout(make_runs(ts))[0]
    assert mirrored[0] % 16 == 8  # the host layout: as aligned as the file, no more
    runs = make_runs(ts, align=256)
    starts, total = layout(runs, align=256)
    at = {t.name: s + t.offset - r.offset for r, s in zip(runs, starts, strict=True) for t in r.tensors}
    assert all(a % 256 == 0 for a in at.values()), at
    # a run goes on where the next tensor is a multiple of 256 bytes on (most weights' sizes)
    assert [[t.name for t in r.tensors] for r in runs] == [["a", "b", "c"], ["d", "e"]]
    ends = sorted((at[t.name], at[t.name] + t.length) for t in ts)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(ends, ends[1:], strict=False)) and ends[-1][1] <= total
