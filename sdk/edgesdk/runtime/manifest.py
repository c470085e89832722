"""The bundle manifest: what a device needs to know to run and verify a bundle.

Plain dataclasses and JSON, so the runtime stays free of build-side dependencies
(the build side imports this module; this module imports nothing from the build side).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RUNTIME_VERSION = "0.1.0"


@dataclass(frozen=True)
class QuantParams:
    """Affine int8 quantization: real = scale * (q - zero_point)."""

    scale: float
    zero_point: int


@dataclass(frozen=True)
class TensorSpec:
    """A tensor at a segment or model boundary, in the ONNX graph's own layout.

    `key` is the backend's name for it (a TFLite signature key, a position for TVM).
    `perm` says how the backend lays it out: onnx_tensor = transpose(backend_tensor, perm);
    None means the same layout. `quant` is set when the backend tensor is int8.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    key: str = ""
    perm: tuple[int, ...] | None = None
    quant: QuantParams | None = None


@dataclass(frozen=True)
class Segment:
    id: str
    device: str  # logical device id: cpu, edgetpu:0, gpu:0
    backend: str  # tvm | tflite | onnxruntime
    artifact: str  # path relative to the bundle root
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Uncompiled int8 model that the CPU runs when the accelerator is absent.
    fallback_artifact: str | None = None
    nodes: int = 0
    predicted_ms: float = 0.0
    # Worker threads for this segment when it runs in a parallel step (0: the runtime's default).
    threads: int = 0


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    sdk_version: str
    min_runtime_version: str
    model: dict[str, Any]
    target: dict[str, Any]
    arch: str  # the bundle's own architecture: x86_64 | aarch64
    device_map: dict[str, str]  # logical id -> physical device string (usb:0)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    segments: tuple[Segment, ...]
    pipeline_stages: tuple[tuple[str, ...], ...]  # segment ids per stage
    predicted: dict[str, float]
    # Inter-operator parallelism: segment ids that may run at once, one tuple per step, steps in
    # order; a segment in no step runs alone, in manifest order. Empty: every segment alone.
    parallel_steps: tuple[tuple[str, ...], ...] = ()
    # Threads each CPU backend uses (the target CPU's cores); 0: the backend's own default.
    cpu_threads: int = 0
    toolchain: dict[str, str] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    edgetpu: dict[str, Any] = field(default_factory=dict)
    accuracy: dict[str, Any] = field(default_factory=dict)
    tuning: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> {sha256, size}

    def to_json(self) -> str:
        return json.dumps(_plain(self), indent=2, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str) -> "Manifest":
        return manifest_from_dict(json.loads(text))

    @staticmethod
    def load(bundle: Path) -> "Manifest":
        return Manifest.from_json((Path(bundle) / "manifest.json").read_text())


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def tensor_from_dict(d: dict[str, Any]) -> TensorSpec:
    q = d.get("quant")
    return TensorSpec(
        name=d["name"],
        shape=tuple(int(x) for x in d["shape"]),
        dtype=d["dtype"],
        key=d.get("key", ""),
        perm=tuple(d["perm"]) if d.get("perm") is not None else None,
        quant=QuantParams(float(q["scale"]), int(q["zero_point"])) if q else None,
    )


def segment_from_dict(d: dict[str, Any]) -> Segment:
    return Segment(
        id=d["id"],
        device=d["device"],
        backend=d["backend"],
        artifact=d["artifact"],
        inputs=tuple(tensor_from_dict(t) for t in d["inputs"]),
        outputs=tuple(tensor_from_dict(t) for t in d["outputs"]),
        fallback_artifact=d.get("fallback_artifact"),
        nodes=int(d.get("nodes", 0)),
        predicted_ms=float(d.get("predicted_ms", 0.0)),
        threads=int(d.get("threads", 0)),
    )


def manifest_from_dict(d: dict[str, Any]) -> Manifest:
    return Manifest(
        schema_version=int(d["schema_version"]),
        sdk_version=d["sdk_version"],
        min_runtime_version=d["min_runtime_version"],
        model=d["model"],
        target=d["target"],
        arch=d["arch"],
        device_map=d["device_map"],
        inputs=tuple(tensor_from_dict(t) for t in d["inputs"]),
        outputs=tuple(tensor_from_dict(t) for t in d["outputs"]),
        segments=tuple(segment_from_dict(s) for s in d["segments"]),
        pipeline_stages=tuple(tuple(s) for s in d["pipeline_stages"]),
        predicted=d.get("predicted", {}),
        parallel_steps=tuple(tuple(s) for s in d.get("parallel_steps", ())),
        cpu_threads=int(d.get("cpu_threads", 0)),
        toolchain=d.get("toolchain", {}),
        calibration=d.get("calibration", {}),
        edgetpu=d.get("edgetpu", {}),
        accuracy=d.get("accuracy", {}),
        tuning=d.get("tuning", {}),
        warnings=tuple(d.get("warnings", ())),
        files=d.get("files", {}),
    )
