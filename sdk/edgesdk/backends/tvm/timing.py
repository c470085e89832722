"""How long a compiled kernel or library takes on this host: `median_ms`, the one place that times a run.

The sparse kernel choice (sparse_measured.py) and the prune plan's layer and segment times
(layer_times.py) all take their times here, so they are measured alike and comparable.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

TIMING_RUNS = 7  # a kernel's time: the median of this many runs after one warm-up


def median_ms(run: Callable[[], object]) -> float:
    """The median wall time of `run()` in milliseconds over TIMING_RUNS runs, after one warm-up run."""
    run()
    times = []
    for _ in range(TIMING_RUNS):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 4)
