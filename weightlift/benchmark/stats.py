"""The statistics every benchmark table uses: medians with spread, and ratios taken run by run.

A ratio of medians hides which runs were slow together; a run's time over its baseline's in the
same round cancels what that round shared (what ran before, what the host was doing), so the
tables report the median of the per-round ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["summarize", "paired_ratio"]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max, quartiles and IQR of ``values`` (inclusive quartiles)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "q1": None, "q3": None, "iqr": None}
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
    }


def paired_ratio(times: Sequence[float | None], base: Sequence[float | None]) -> dict[str, Any]:
    """Run i over baseline run i of the same round, for the rounds both finished; their median."""
    ratios = [a / b for a, b in zip(times, base, strict=False) if a is not None and b is not None and b > 0]
    return {"ratios": ratios, "median": statistics.median(ratios) if ratios else None}
