"""What the benchmarks share for their output: latency summaries (profile_throughput.py, profile_serving.py) and
CSV files that each run appends to."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

STAT_KEYS = ("mean", "p50", "p90", "p99")


def summarize(xs: list[float]) -> dict[str, float]:
    """Mean and the p50 / p90 / p99 percentiles of the finite-or-not values of xs (NaNs, i.e. missing
    measurements, are left out); all NaN when nothing is left."""
    a = np.asarray([x for x in xs if x == x], dtype=float)
    if a.size == 0:
        return {k: float("nan") for k in STAT_KEYS}
    return {"mean": float(a.mean()), **{k: float(np.percentile(a, int(k[1:]))) for k in STAT_KEYS[1:]}}


def append_csv(path: Path, header: list, rows: list[list]) -> None:
    """Appends ``rows`` to the CSV file ``path``, writing ``header`` first when the file is new (its folder
    created if need be): every run of a benchmark adds its rows to the same table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(header)
        w.writerows(rows)
