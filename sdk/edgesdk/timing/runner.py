"""What runs and times a bundle: MetaSchedule's runner role, apart from what builds one.

A runner `open`s a bundle directory as a handle that runs it (`run` one sample's feeds, `run_all`
several: a board runs them in one session), for checks of its outputs; and `measure`s it: milliseconds
per inference of `runs` inferences after `warmup`, on the inputs in a .npz file. Its implementations:

- `InProcess`: the runtime's executor in this process (cheap to start; a TVM library it loads is never
  unloaded, so a large bundle's weights stay held);
- `FreshProcess`: each `open`'s run and each measurement in a child process of its own
  (`python -m edgesdk.timing.child`), which loads the bundle alone: no other runtime's threads spin on
  the cores, as on a device;
- `scheduling.boards.BoardRunner`: on a board over TVM RPC;
- `FakeRunner`: for tests, times given per bundle instead of measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .clock import laps

RUNS = 10  # inferences per measurement, after WARMUP
WARMUP = 3
CHILD_TIMEOUT_S = 600


class Handle(Protocol):
    """An opened bundle: its inputs' and outputs' specs, and what runs it."""

    bundle: Path
    inputs: tuple
    outputs: tuple

    def run(self, feeds: dict) -> dict: ...

    def run_all(self, feeds: list[dict]) -> list[dict]: ...

    def close(self) -> None: ...


class Runner(Protocol):
    local: bool  # it runs bundles on this host's CPU

    def open(self, bundle: Path) -> Handle: ...

    def measure(self, bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]: ...


def failure(e: BaseException) -> str:
    """One line of why a bundle did not build, run or agree: what a record keeps of the error."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


class Loaded:
    """A bundle loaded by the runtime's executor in this process."""

    def __init__(self, bundle: Path) -> None:
        from ..runtime.executor import BundleModel

        self.bundle = Path(bundle)
        self.model = BundleModel(self.bundle, log=lambda line: None)
        self.inputs, self.outputs = tuple(self.model.inputs), tuple(self.model.outputs)

    def run(self, feeds: dict) -> dict:
        return self.model.run(feeds)

    def run_all(self, feeds: list[dict]) -> list[dict]:
        return [self.model.run(f) for f in feeds]

    def close(self) -> None:
        self.model.close()


class InProcess:
    local = True

    def open(self, bundle: Path) -> Loaded:
        return Loaded(bundle)

    def measure(self, bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]:
        from . import child

        return child.measure(str(bundle), str(feeds), warmup, runs)


@dataclass(frozen=True)
class Apart:
    """A bundle never loaded by this process: `run_all` runs it in a child process of its own."""

    bundle: Path
    inputs: tuple
    outputs: tuple

    def run_all(self, feeds: list[dict]) -> list[dict]:
        with tempfile.TemporaryDirectory(prefix="check-", dir=self.bundle.parent) as tmp:
            given, got = Path(tmp) / "feeds.npz", Path(tmp) / "outputs.npz"
            np.savez(given, **{f"{i}|{name}": value for i, f in enumerate(feeds) for name, value in f.items()})
            done = _child("run", self.bundle, given, got)
            if done.returncode != 0:
                raise RuntimeError(f"its run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            outputs: list[dict] = [{} for _ in feeds]
            with np.load(got) as values:
                for key in values.files:
                    i, name = key.split("|", 1)
                    outputs[int(i)][name] = values[key]
            return outputs

    def run(self, feeds: dict) -> dict:
        return self.run_all([feeds])[0]

    def close(self) -> None:
        pass


class FreshProcess:
    local = True

    def open(self, bundle: Path) -> Apart:
        from ..runtime.manifest import Manifest

        manifest = Manifest.load(bundle)
        return Apart(Path(bundle), manifest.inputs, manifest.outputs)

    def measure(self, bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]:
        return measure_alone(bundle, feeds, warmup=warmup, runs=runs)


def measure_alone(bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]:
    """One measurement of a bundle in a child process of its own: milliseconds per inference of `runs`
    inferences after `warmup`, on the inputs in `feeds` (.npz)."""
    done = _child("measure", bundle, feeds, warmup, runs)
    if done.returncode != 0:
        raise RuntimeError(f"the timing run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgesdk.timing.child", *map(str, args)], capture_output=True,
                          text=True, env=child_env(), timeout=CHILD_TIMEOUT_S)


def child_env() -> dict[str, str]:
    """A child process's environment: this one's (the threads it set for the runners, TVM_NUM_THREADS and
    EDGESDK_NUM_THREADS), with edgesdk importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    return env


class FakeRunner:
    """A TEST DOUBLE: bundles run in this process (their outputs are real, so checks still refuse a wrong
    one), and each measurement takes `ms` of the bundle directory's name (a function of the path, or a
    mapping) instead of being measured; `asked` lists the directories measured, in turn."""

    local = True

    def __init__(self, ms: Mapping[str, float] | Callable[[Path], float]) -> None:
        self.ms = ms
        self.asked: list[str] = []

    def open(self, bundle: Path) -> Loaded:
        return Loaded(bundle)

    def measure(self, bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]:
        self.asked.append(Path(bundle).name)
        ms = self.ms(Path(bundle)) if callable(self.ms) else self.ms[Path(bundle).name]
        return [float(ms)] * runs


__all__ = ["CHILD_TIMEOUT_S", "RUNS", "WARMUP", "Apart", "FakeRunner", "FreshProcess", "Handle", "InProcess", "Loaded",
           "Runner", "child_env", "failure", "laps", "measure_alone"]
