"""How long a compiled kernel or library takes on this host: `median_ms`, what the TVM backend's own choices
are timed by.

The sparse kernel choice (sparse_measured.py) and the prune plan's layer and segment times
(layer_times.py) all take their times here, so they are measured alike and comparable. The loop is the
one every in-process measurement uses (`edgesdk.timing.laps`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ...timing.clock import laps

TIMING_RUNS = 7  # a kernel's time: the median of this many runs after one warm-up


def median_ms(run: Callable[[], object]) -> float:
    """The median wall time of `run()` in milliseconds over TIMING_RUNS runs, after one warm-up run."""
    return round(statistics.median(laps(run, warmup=1, runs=TIMING_RUNS)), 4)
