"""Running and timing bundles, and remembering what was timed: the roles the tune stage's choice of a CPU
span's backend (`scheduling/selection.py`) and `edgesdk calibrate` (`scheduling/backend_timing.py`)
share. A runner (`runner.py`) opens a bundle to check its outputs and measures it; the timing cache
(`cache.py`) keeps a build's measurements for the next. Built on the runtime alone: what builds a
bundle (the backends) sits above.
"""

from .cache import CACHE_HINT, CACHE_MAX_BYTES, TimingCache, entry_problem
from .runner import (RUNS, WARMUP, Apart, FakeRunner, FreshProcess, Handle, InProcess, Loaded, Runner, failure, laps,
                     measure_alone)

__all__ = ["CACHE_HINT", "CACHE_MAX_BYTES", "RUNS", "WARMUP", "Apart", "FakeRunner", "FreshProcess", "Handle", "InProcess",
           "Loaded", "Runner", "TimingCache", "entry_problem", "failure", "laps", "measure_alone"]
