"""Latency summaries shared by the profilers (profile_throughput.py, profile_serving.py)."""

from __future__ import annotations

import numpy as np

STAT_KEYS = ("mean", "p50", "p90", "p99")


def summarize(xs: list[float]) -> dict[str, float]:
    """Mean and the p50 / p90 / p99 percentiles of the finite-or-not values of xs (NaNs, i.e. missing
    measurements, are left out); all NaN when nothing is left."""
    a = np.asarray([x for x in xs if x == x], dtype=float)
    if a.size == 0:
        return {k: float("nan") for k in STAT_KEYS}
    return {"mean": float(a.mean()), **{k: float(np.percentile(a, int(k[1:]))) for k in STAT_KEYS[1:]}}
