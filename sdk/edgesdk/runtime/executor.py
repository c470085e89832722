"""Execute a bundle's plan: segments in order, tensors handed from device to device."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .backends import open_runner
from .manifest import Manifest


class BundleModel:
    """A loaded bundle. `run(feeds)` is thread-safe; `stream(frames)` yields results in input order.

    `artifacts` replaces segment artifacts by path with twins built for this host's CPU (the build
    uses it to run the aarch64 or CUDA segments of a bundle on the build host for the golden output).
    """

    def __init__(self, bundle: Path, *, artifacts: dict[str, Path] | None = None,
                 log: Callable[[str], None] | None = None):
        self.bundle = Path(bundle)
        self.manifest = Manifest.load(self.bundle)
        self.log = log if log is not None else (lambda s: print(s, file=sys.stderr))
        self.notes: list[str] = []
        self.runners = []
        t0 = time.perf_counter()
        for seg in self.manifest.segments:
            if artifacts and seg.id in artifacts:  # a twin built for this host's CPU
                seg = dataclasses.replace(seg, artifact=str(Path(artifacts[seg.id]).resolve()), device="cpu")
            physical = self.manifest.device_map.get(seg.device)
            runner = open_runner(self.bundle, seg, physical)
            if runner.note:
                self.notes.append(runner.note)
                self.log(f"runtime: {runner.note}")
            self.runners.append((seg, runner))
        self.load_seconds = time.perf_counter() - t0
        self._lock = threading.Lock()

    @property
    def inputs(self):
        return self.manifest.inputs

    @property
    def outputs(self):
        return self.manifest.outputs

    def run(self, feeds: dict[str, np.ndarray], *, extra_outputs: Iterable[str] = ()) -> dict[str, np.ndarray]:
        """Outputs by name; `extra_outputs` may name any tensor that crosses a segment boundary."""
        self._check(feeds)
        env = {k: np.asarray(v) for k, v in feeds.items()}
        for seg, runner in self.runners:
            env.update(runner.run({t.name: env[t.name] for t in seg.inputs}))
        names = [o.name for o in self.manifest.outputs] + list(extra_outputs)
        return {n: env[n] for n in names}

    def stream(self, frames: Iterable[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
        for feeds in frames:
            yield self.run(feeds)

    def _check(self, feeds: dict[str, np.ndarray]) -> None:
        want = {t.name: t for t in self.manifest.inputs}
        missing = sorted(set(want) - set(feeds))
        extra = sorted(set(feeds) - set(want))
        if missing or extra:
            raise ValueError(f"inputs do not match the model: missing {missing}, unexpected {extra}; "
                             f"the model takes {sorted(want)}")
        for name, spec in want.items():
            shape = tuple(np.shape(feeds[name]))
            if shape != tuple(spec.shape):
                raise ValueError(f"input '{name}' has shape {shape}, the model takes {tuple(spec.shape)}")

