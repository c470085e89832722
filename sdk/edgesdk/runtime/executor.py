"""Execute a bundle's plan: segments in order, tensors handed from device to device; `stream`
pipelines frames over the devices (`streaming.py`).

Inter-operator parallelism: the manifest's `parallel_steps` name segments (groups of independent
nodes, `scheduling/parallel.py`) that run at once, each on a worker thread; each gets the number of threads the plan gave it (`Segment.threads`). `run`
executes them one after another instead when the model is opened with `parallel=False` (or with
EDGESDK_SEQUENTIAL=1 in the environment): the same segments, for measuring what parallelism buys.

CPU threads: TVM's runtime sizes its thread pool once per thread, by default to half the logical
CPUs on x86 (it assumes hyper-threading), so on a 2-CPU host it runs one thread. The bundle sets
TVM_NUM_THREADS to the target CPU's cores (at most this host's CPUs) unless the environment sets it,
and TVM_BIND_THREADS=0 unless set: TVM pins its pool's worker i to core i, so two pools (parallel
steps) would share cores while others idle, and on a host where another process holds a core the
pinned worker waits for it at every kernel's barrier (measured: MobileNetV2 at 2 pinned threads took
27 ms against 13 ms at one thread while the other core was busy). With parallel steps it also sets
TVM_THREAD_POOL_SPIN_COUNT=3000 unless set: an idle pool worker of one thread spins on a core the
next step's groups need (NASNetMobile's parallel bundle on 2 cores: 27 ms with TVM's default spin,
21.7 ms with 3000; its one-segment bundle 16.2 and 15.1 ms).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .backends import open_runner
from .inputs import FeedCheck
from .manifest import Manifest, check_paths


class BundleModel:
    """A loaded bundle. `run(feeds)` is thread-safe; `stream(frames)` yields results in input order.

    `artifacts` replaces segment artifacts by path with twins built for this host's CPU (the build
    uses it to run the aarch64 or CUDA segments of a bundle on the build host for the golden output).
    """

    def __init__(self, bundle: Path, *, artifacts: dict[str, Path] | None = None,
                 log: Callable[[str], None] | None = None, parallel: bool | None = None):
        self.bundle = Path(bundle)
        self.manifest = Manifest.load(self.bundle)
        check_paths(self.bundle, self.manifest)  # nothing outside the bundle is ever loaded
        self.log = log if log is not None else (lambda s: print(s, file=sys.stderr))
        self._feed_check = FeedCheck(self.manifest.inputs)
        self.notes: list[str] = []
        self.runners = []
        self.parallel = (os.environ.get("EDGESDK_SEQUENTIAL", "") in ("", "0")) if parallel is None else parallel
        _configure_threads(self.manifest)
        t0 = time.perf_counter()
        opened = {}  # (artifact, device) -> its runner: segments that share an artifact share its interpreter
        for seg in self.manifest.segments:
            if artifacts and seg.id in artifacts:  # a twin built for this host's CPU
                seg = dataclasses.replace(seg, artifact=str(Path(artifacts[seg.id]).resolve()), device="cpu")
            physical = self.manifest.device_map.get(seg.device)
            first = opened.get((seg.artifact, seg.device))
            if first is not None and hasattr(first, "for_segment"):
                runner = first.for_segment(seg)
            else:
                runner = opened[seg.artifact, seg.device] = open_runner(self.bundle, seg, physical,
                                                                       alone=len(self.manifest.segments) == 1)
            if runner.note:
                self.notes.append(runner.note)
                self.log(f"runtime: {runner.note}")
            self.runners.append((seg, runner))
        self.load_seconds = time.perf_counter() - t0
        # `run` runs the plan's own segments; a stream deals frames over the plan and its replicas
        self.steps = _steps(self.manifest, [(seg, r) for seg, r in self.runners if not seg.replica])
        width = max((len(step) for step in self.steps), default=1)
        # the calling thread keeps its own thread count: parallel steps run on workers only
        self._pool = concurrent.futures.ThreadPoolExecutor(width, "edgesdk-step") if width > 1 else None

    @property
    def inputs(self):
        return self.manifest.inputs

    @property
    def outputs(self):
        return self.manifest.outputs

    def run(self, feeds: dict[str, np.ndarray], *, extra_outputs: Iterable[str] = (),
            allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
        """Outputs by name; `extra_outputs` may name any tensor that crosses a segment boundary.
        The feeds are checked first (`inputs.py`); `allow_nonfinite` lets NaN and inf through."""
        env = self._check(feeds, allow_nonfinite)  # a new dict of arrays: the segments' outputs join it
        for step in self.steps:
            if len(step) == 1 or not self.parallel or self._pool is None:
                for seg, runner in step:
                    env.update(_call(runner, 0, _feeds(seg, runner, env)))
                continue
            futures = [self._pool.submit(_call, runner, seg.threads, _feeds(seg, runner, env)) for seg, runner in step]
            for future in futures:
                env.update(future.result())
        names = [o.name for o in self.manifest.outputs] + list(extra_outputs)
        return {n: _host(env[n]) for n in names}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def release(self) -> None:
        """Close, and let go of every segment's runtime and the weights it holds: the model cannot run
        after this (the build releases its host run before it loads the float model to compare with)."""
        self.close()
        self.runners, self.steps = [], []

    def stream(self, frames: Iterable[dict[str, np.ndarray]], *, depth: int | None = None,
               allow_nonfinite: bool = False) -> Iterator[dict[str, np.ndarray]]:
        """Results of `frames`, in input order, pipelined over the devices (`streaming.py`): one worker
        per device, at most `depth` frames in flight (default: one per device, plus one), frames dealt in
        turn over the plan and its replicas (`Manifest.replicas`). An error in any segment is raised here
        for its frame; closing the generator stops the workers."""
        from .streaming import stream

        devices = {seg.device for seg, _ in self.runners}
        names = [o.name for o in self.manifest.outputs]

        def checked():
            for feeds in frames:
                yield self._check(feeds, allow_nonfinite)

        by_id = {seg.id: (seg, r) for seg, r in self.runners}
        return stream([(seg, r) for seg, r in self.runners if not seg.replica], _feeds,
                      lambda runner, feeds: _call(runner, 0, feeds),
                      lambda env: {n: _host(env[n]) for n in names}, checked(),
                      depth if depth is not None else len(devices) + 1,
                      replicas=[[by_id[i] for i in ids] for ids in self.manifest.replicas])

    def _check(self, feeds: dict[str, np.ndarray], allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
        """The feeds in the model's dtypes, checked before any segment runs (`inputs.py`: ValueError for
        names and shapes, InputError for dtypes and values); each cast is noted once."""
        checked, notes = self._feed_check(feeds, allow_nonfinite=allow_nonfinite)
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
                self.log(f"runtime: {note}")
        return checked



def _steps(manifest: Manifest, runners: list) -> list[list]:
    """The segments grouped into steps in manifest order; a parallel step sits where its first
    segment is (the plan puts a step's segments next to each other)."""
    step_of = {sid: i for i, step in enumerate(manifest.parallel_steps) for sid in step}
    steps: list[list] = []
    placed: dict[int, list] = {}
    for seg, runner in runners:
        i = step_of.get(seg.id)
        if i is None:
            steps.append([(seg, runner)])
        elif i in placed:
            placed[i].append((seg, runner))
        else:
            placed[i] = [(seg, runner)]
            steps.append(placed[i])
    return steps


_local = threading.local()


def _call(runner, threads: int, feeds: dict) -> dict:
    """Run a segment on this thread with `threads` CPU threads (0: leave the thread as it is). A TVM
    runner's outputs stay TVM tensors (see `_feeds`)."""
    if threads and getattr(_local, "threads", None) != threads and hasattr(runner, "set_threads"):
        runner.set_threads(threads)
        _local.threads = threads
    if getattr(runner, "native_tensors", False):
        return runner.run(feeds, native=True)
    return runner.run(feeds)


def _feeds(seg, runner, env: dict) -> dict:
    """A segment's inputs: TVM tensors go to a TVM runner as they are, to any other runner as numpy."""
    if getattr(runner, "native_tensors", False):
        return {t.name: env[t.name] for t in seg.inputs}
    return {t.name: _host(env[t.name]) for t in seg.inputs}


def _host(value):
    return value if isinstance(value, np.ndarray) else value.numpy()


def _configure_threads(manifest: Manifest) -> None:
    if manifest.cpu_threads:  # TVM's pool and LiteRT's interpreters (EDGESDK_NUM_THREADS) on the target's cores
        threads = str(min(manifest.cpu_threads, os.cpu_count() or 1))
        os.environ.setdefault("TVM_NUM_THREADS", threads)
        os.environ.setdefault("EDGESDK_NUM_THREADS", threads)
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    # TVM's idle workers spin (yielding) for a long while after each kernel: where another runner shares
    # the cores (a parallel step, or segments of another backend), they stop spinning soon
    runners = {s.backend for s in manifest.segments}
    if manifest.parallel_steps or ("tvm" in runners and len(runners) > 1):
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "3000")
