"""Segment runners: one per backend, loaded lazily so a bundle needs only what it uses.

A runner is built from the bundle directory, the segment and the physical device it
should open, and maps ONNX-named input arrays to ONNX-named output arrays in the
ONNX graph's own layout and dtype; layout permutation and int8 (de)quantization are
the runner's business (see `TensorSpec.perm` and `TensorSpec.quant`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

import numpy as np

from ..manifest import Segment


class Runner(Protocol):
    note: str  # a line for the user when the runner fell back (empty otherwise)
    # Optional: `native_tensors = True` when `run(feeds, native=True)` takes and returns the backend's
    # own tensors (TVM), which the executor passes from segment to segment without copies; and
    # `set_threads(n)` to size the calling thread's pool for a parallel step.

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


_MODULES = {"tvm": "tvm_runner", "tflite": "tflite_runner", "onnxruntime": "ort_runner", "openvino": "ov_runner"}


def open_runner(bundle: Path, segment: Segment, physical_device: str | None, *, alone: bool = False) -> Runner:
    """`alone`: the segment is the bundle's only work on the CPU, so its threads may spin between
    kernels (faster) without taking the cores from another backend's segment."""
    module = importlib.import_module(f".{_MODULES[segment.backend]}", __package__)
    return module.open_runner(Path(bundle), segment, physical_device, alone=alone)
