"""The one timing loop: what every in-process measurement (the child's, the TVM backend's kernels) times by."""

from __future__ import annotations

import time
from collections.abc import Callable


def laps(run: Callable[[], object], warmup: int, runs: int) -> list[float]:
    """Milliseconds of each of `runs` calls of `run` after `warmup` untimed ones, in this process."""
    out = []
    for k in range(warmup + runs):
        t0 = time.perf_counter()
        run()
        if k >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out
