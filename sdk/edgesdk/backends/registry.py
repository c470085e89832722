"""The build side's backends by name: what a stage needs to know of one without importing it.

A plan segment names its backend (`plan.json`: "tvm", "tflite", "onnxruntime"); the stages ask the
registry what that backend does instead of comparing names: the tune stage searches the segments of a
backend that `tunes`, the compress stage converts those of one that `quantizes`, the package stage has
each segment compiled by its backend (`Backend.compile`: a `CompileJob` in, a `Compiled` out), and a
bundle's requirements.txt lists each used backend's `runtime_dists`, in `rank` order. MetaSchedule's
string-keyed roles are the model. Registering here imports nothing heavy: a backend's `compiler` is
named as "module:function" and imported when a segment is compiled, and its compiler and runtime
libraries stay imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..runtime.manifest import TensorSpec


@dataclass(frozen=True)
class CompileJob:
    """One plan segment for a backend to compile into a bundle."""

    segment: Any  # the plan's segment (scheduling.plan.PlanSegment: id, device, backend, nodes, inputs, outputs)
    model: Any  # its ONNX graph (onnx.ModelProto): the schedule stage's segments/<id>.onnx
    device: Any  # the target's entry for the segment's device kind (a TVM backend reads its codegen)
    segments_dir: Path  # bundle/segments: the artifact goes here
    tuning_db: Path  # the tune stage's database for this device kind (it may hold no records)
    compressed: dict | None  # the compress stage's entry for the segment, its "dir" added; None if none
    twin_dir: Path  # a build of the segment for this host, when the bundle's cannot run here (never shipped)
    log: Callable[[str], None]


@dataclass(frozen=True)
class Compiled:
    artifact: str  # relative to the bundle root
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    fallback_artifact: str | None = None  # what the CPU runs when the accelerator is missing
    twin: Path | None = None  # the twin for the build host's golden run
    tuned: dict | None = None  # where the kernels' schedules came from (the manifest's tuning.segments)


@dataclass(frozen=True)
class Backend:
    name: str  # what plan.json's segments say
    runner: str  # the runtime's runner of its artifacts (runtime/backends), what the manifest says
    rank: int  # the order of its lines in a bundle's requirements.txt
    runtime_dists: tuple[str, ...]  # the PyPI distributions a device needs to run its artifacts
    tunes: bool = False  # the tune stage searches its segments' kernels
    quantizes: bool = False  # the compress stage converts its segments with calibration data
    compiler: str = ""  # "module:function" taking a CompileJob, returning a Compiled
    # "module:function" (node, shapes, consts) -> why it cannot lower the node, or None; the shipped
    # backends' checks are legalization/support.Tables' own (they share caches of their compilers)
    lowering: str = ""

    def compile(self, job: CompileJob) -> Compiled:
        return _function(self.compiler, f"backend {self.name!r} names no compiler")(job)

    def lowering_check(self) -> Callable[..., str | None]:
        return _function(self.lowering, f"backend {self.name!r} names no lowering check")


def _function(path: str, missing: str) -> Callable:
    module, _, function = path.partition(":")
    if not function:
        raise ValueError(missing)
    return getattr(importlib.import_module(module), function)


_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _BACKENDS.pop(name, None)


@contextlib.contextmanager
def registered(backend: Backend) -> Iterator[Backend]:
    """For tests: the backend is known inside the block and forgotten after it."""
    register(backend)
    try:
        yield backend
    finally:
        unregister(backend.name)


def backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"no backend named {name!r}; known: {', '.join(sorted(_BACKENDS))}") from None


def backends() -> list[Backend]:
    """Every registered backend, in `rank` order."""
    return sorted(_BACKENDS.values(), key=lambda b: (b.rank, b.name))
