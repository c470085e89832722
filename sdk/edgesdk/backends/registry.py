"""The build side's backends by name: what a stage needs to know of one without importing it.

A plan segment names its backend (`plan.json`: "tvm", "tflite", "onnxruntime"); the stages ask the
registry what that backend does instead of comparing names: the tune stage searches the segments of a
backend that `tunes`, the compress stage converts those of one that `quantizes`, and a bundle's
requirements.txt lists each used backend's `runtime_dists`, in `rank` order. MetaSchedule's
string-keyed roles are the model. Registering here imports nothing heavy: a backend's compiler and
runtime libraries stay imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Backend:
    name: str  # what plan.json's segments say
    runner: str  # the runtime's runner of its artifacts (runtime/backends), what the manifest says
    rank: int  # the order of its lines in a bundle's requirements.txt
    runtime_dists: tuple[str, ...]  # the PyPI distributions a device needs to run its artifacts
    tunes: bool = False  # the tune stage searches its segments' kernels
    quantizes: bool = False  # the compress stage converts its segments with calibration data


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
