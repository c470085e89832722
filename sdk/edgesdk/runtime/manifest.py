"""The bundle manifest: what a device needs to know to run and verify a bundle.

Plain dataclasses and JSON, so the runtime stays free of build-side dependencies
(the build side imports this module; this module imports nothing from the build side).

A manifest is read through one validating schema (`MANIFEST` below): every field's type and range,
every path relative and inside the bundle, every segment id a plan names defined, every tensor a
segment takes produced before it. A manifest that does not follow it raises `ManifestError` naming
the field (`manifest.segments[1].artifact`), so nothing is loaded from a bundle whose manifest is
malformed, written for another schema (`schema_version`) or needing a newer runtime
(`min_runtime_version`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

SCHEMA_VERSION = 1
# 0.2.0: replicas (data parallelism in a stream) and segments sharing an artifact
# 0.3.0: signatures (manifest.sig), bundle versions, provenance; install into A/B slots
# 0.4.0: the golden self-test's tolerance per tensor, derived at build time (`golden`)
RUNTIME_VERSION = "0.4.0"


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
    `valid_range` is set on a model input that indexes a table (token ids): the values [low, high]
    it may take (`edgesdk.ir.index_ranges`); the runtime refuses others before any segment runs.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    key: str = ""
    perm: tuple[int, ...] | None = None
    quant: QuantParams | None = None
    # written only when set, so that a manifest without index inputs reads as before
    valid_range: tuple[int, int] | None = field(default=None, metadata={"omit_if_none": True})


@dataclass(frozen=True)
class Segment:
    id: str
    device: str  # logical device id: cpu, edgetpu:0, gpu:0
    backend: str  # tvm | tflite | onnxruntime | openvino
    artifact: str  # path relative to the bundle root
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Uncompiled int8 model that the CPU runs when the accelerator is absent.
    fallback_artifact: str | None = None
    nodes: int = 0
    predicted_ms: float = 0.0
    # Worker threads for this segment when it runs in a parallel step (0: the runtime's default).
    threads: int = 0
    # A segment only a replica runs (`Manifest.replicas`): the number of that replica (0: the plan's own).
    replica: int = 0


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
    # Data parallelism in a stream: per replica k >= 1, the segment ids its frames run, in order (the
    # plan's segments with the accelerators swapped: its own segments where a device moved, marked
    # `replica: k`, and the plan's others); frame f runs replica f mod (1 + len(replicas)). `run` runs
    # the plan's own segments (replica 0) only.
    replicas: tuple[tuple[str, ...], ...] = ()
    # Threads each CPU backend uses (the target CPU's cores); 0: the backend's own default.
    cpu_threads: int = 0
    toolchain: dict[str, str] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    edgetpu: dict[str, Any] = field(default_factory=dict)
    accuracy: dict[str, Any] = field(default_factory=dict)
    # the self-test's tolerance per tensor, each with its reason (runtime/selftest.py): `tensors`, each
    # segment output on its golden inputs; `outputs`, each model output end to end. {}: a bundle from
    # before they were recorded, judged by 1 LSB (int8) and 1e-4 relative (float)
    golden: dict[str, Any] = field(default_factory=dict)
    tuning: dict[str, Any] = field(default_factory=dict)
    # --prune: the method, the layers pruned and their sparsity, the correction, the pruned model's fidelity
    # to the dense one on the calibration data, and how many convolutions run sparse kernels; {}: not pruned
    pruning: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> {sha256, size}
    # monotonically increasing per product: a device refuses a bundle older than the one installed
    bundle_version: int = 0
    # who signed manifest.sig: {"algorithm": "ed25519", "key_id": 16 hex}; {}: unsigned (runtime/trust.py)
    signing: dict[str, Any] = field(default_factory=dict)
    # what the bundle was built from: the digests of the model, target, tuning database and calibration
    # data, the SDK's and its toolchain's versions, the SBOM's file
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(_plain(self), indent=2, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str | bytes) -> "Manifest":
        """Parse and validate; `ManifestError` names the first field at fault."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest.json is {len(text):,} bytes, more than {MAX_MANIFEST_BYTES:,}")
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ManifestError(f"manifest.json is not JSON ({str(e)[:200]})") from None
        return manifest_from_dict(data)

    @staticmethod
    def load(bundle: Path) -> "Manifest":
        path = Path(bundle) / "manifest.json"
        try:
            with open(path, "rb") as f:
                text = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            raise ManifestError(f"manifest.json cannot be read ({e.strerror or e})") from None
        return Manifest.from_json(text)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):  # a field marked omit_if_none is written only when set
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)}
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
        valid_range=(int(d["valid_range"][0]), int(d["valid_range"][1])) if d.get("valid_range") is not None else None,
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
        replica=int(d.get("replica", 0)),
    )


def manifest_from_dict(d: Any) -> Manifest:
    """A validated manifest (`MANIFEST`, then the cross-references between its parts)."""
    _unicode_text(d, "manifest")
    MANIFEST(d, "manifest")
    if d["schema_version"] != SCHEMA_VERSION:
        raise ManifestError(f"manifest.schema_version is {d['schema_version']}: this runtime reads schema version "
                            f"{SCHEMA_VERSION} only (a bundle from another edgesdk release)")
    if _version(d["min_runtime_version"]) > _version(RUNTIME_VERSION):
        raise RuntimeTooOld(f"the bundle needs runtime {d['min_runtime_version']} or newer; this runtime is "
                            f"{RUNTIME_VERSION}")
    _check_references(d)
    return Manifest(
        schema_version=d["schema_version"],
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
        replicas=tuple(tuple(s) for s in d.get("replicas", ())),
        cpu_threads=d.get("cpu_threads", 0),
        toolchain=d.get("toolchain", {}),
        calibration=d.get("calibration", {}),
        edgetpu=d.get("edgetpu", {}),
        accuracy=d.get("accuracy", {}),
        golden=d.get("golden", {}),
        tuning=d.get("tuning", {}),
        pruning=d.get("pruning", {}),
        warnings=tuple(d.get("warnings", ())),
        files=d.get("files", {}),
        bundle_version=d.get("bundle_version", 0),
        signing=d.get("signing", {}),
        provenance=d.get("provenance", {}),
    )


def check_paths(bundle: Path, manifest: Manifest) -> None:
    """Every artifact the manifest names is a regular file inside `bundle`, reached without links.

    The schema already refuses absolute paths and `..`; this catches a link planted in the bundle
    (a segment, or a directory on its way, pointing elsewhere). Called before anything is loaded."""
    for seg in manifest.segments:
        for what, rel in (("artifact", seg.artifact), ("fallback_artifact", seg.fallback_artifact)):
            if rel is not None:
                problem = path_problem(bundle, rel)
                if problem:
                    raise ManifestError(f"segment {seg.id}: {what} {rel}: {problem}")


def path_problem(bundle: Path, rel: str) -> str:
    """Why `rel` is not a regular file inside `bundle` reached without links ('' when it is)."""
    root = os.path.realpath(bundle)
    path = os.path.join(root, *rel.split("/"))
    if os.path.realpath(path) != path:
        return "leads through a link (a bundle holds none)"
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "no such file in the bundle"
    return "" if stat.S_ISREG(mode) else "not a regular file"


# --- the schema ------------------------------------------------------------------------------
# A spec is a function (value, where) that raises ManifestError naming `where` when the value does
# not fit. The sizes bound what a hostile manifest can make the reader allocate or loop over.

MAX_MANIFEST_BYTES = 16 << 20
MAX_ITEMS = 100_000  # segments, files, tensors per list
MAX_TEXT = 65_536
MAX_BUNDLE_VERSION = 2**63 - 1  # a signed 64-bit integer: what every reader of a version can hold
DTYPES = ("float32", "float16", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
          "uint64", "bool")
BACKENDS = ("tvm", "tflite", "onnxruntime", "openvino")
ARCHES = ("x86_64", "aarch64")
_DEVICE_ID = re.compile(r"^(cpu|[a-z][a-z0-9_]{0,31}:[0-9]{1,4})$")
_VERSION = re.compile(r"^[0-9]{1,6}\.[0-9]{1,6}\.[0-9]{1,6}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

Spec = Callable[[Any, str], None]


class ManifestError(ValueError):
    """manifest.json is not a manifest this runtime can use; the message names the field at fault."""


class RuntimeTooOld(ManifestError):
    """The bundle needs a newer runtime than this one."""


def _fail(where: str, problem: str) -> None:
    raise ManifestError(f"{where}: {problem}")


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unicode_text(document: Any, where: str) -> None:
    """Every string, keys included, is Unicode text. JSON's \\ud800 escapes (and surrogates encoded in
    UTF-8, which json.loads passes) make lone surrogates, which no file name holds, no terminal prints
    and UTF-8 cannot encode: the free-form parts (provenance, calibration) are printed as they are.
    Each value's place is a link to its parent's, spelled out only for the message."""
    stack: list[tuple[Any, Any]] = [(document, None)]
    while stack:
        value, place = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                stack += [(k, (_KEY, place)), (v, (k, place))]
        elif isinstance(value, list):
            stack += [(v, (i, place)) for i, v in enumerate(value)]
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as e:
                _fail(_spelled(where, place), f"{_shown(value)} is not Unicode text (a lone surrogate at "
                                              f"character {e.start})")


_KEY = object()  # the place of a mapping's key, not of its value


def _spelled(root: str, place: Any) -> str:
    steps = []
    while place is not None:
        step, place = place
        steps.append(step)
    for step in reversed(steps):
        root += " key" if step is _KEY else f"[{step}]" if isinstance(step, int) else f".{str(step)[:60]}"
    return root


def _any(value: Any, where: str) -> None:
    pass


def _text(value: Any, where: str) -> None:
    if not isinstance(value, str):
        _fail(where, f"expected a string, got {_shown(value)}")
    if len(value) > MAX_TEXT:
        _fail(where, f"a string of {len(value):,} characters (at most {MAX_TEXT:,})")


def _flag(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        _fail(where, f"expected true or false, got {_shown(value)}")


def _integer(lo: int, hi: int) -> Spec:
    def check(value: Any, where: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(where, f"expected an integer, got {_shown(value)}")
        if not lo <= value <= hi:
            _fail(where, f"{value} is outside [{lo}, {hi}]")
    return check


def _number(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(where, f"expected a finite number, got {_shown(value)}")


def _positive(value: Any, where: str) -> None:
    _number(value, where)
    if value <= 0:
        _fail(where, f"expected a positive number, got {_shown(value)}")


def _pattern(regex: re.Pattern, what: str) -> Spec:
    def check(value: Any, where: str) -> None:
        _text(value, where)
        if not regex.match(value):
            _fail(where, f"{_shown(value)} is not {what}")
    return check


def _literal(*allowed: Any) -> Spec:
    def check(value: Any, where: str) -> None:
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            _fail(where, f"{_shown(value)} is not one of {', '.join(map(str, allowed))}")
    return check


def _path(value: Any, where: str) -> None:
    """A path relative to the bundle root, '/'-separated, with no '.', '..' or empty part."""
    _text(value, where)
    parts = value.split("/")
    if not value or len(value) > 1024 or "\\" in value or "\0" in value:
        _fail(where, f"{_shown(value)} is not a bundle path")
    if value.startswith("/"):
        _fail(where, f"{_shown(value)} is absolute; every path in a bundle is relative to its root")
    if any(part in ("", ".", "..") or len(part.encode()) > 255 for part in parts):
        _fail(where, f"{_shown(value)} leaves the bundle or is not normalized ('..', '.' or an empty part)")


def _nullable(spec: Spec) -> Spec:
    def check(value: Any, where: str) -> None:
        if value is not None:
            spec(value, where)
    return check


def _absent_or(spec: Spec) -> Spec:
    """None or {} (an informational part that is not there, as `edgesdk inspect` takes them), or `spec`."""
    def check(value: Any, where: str) -> None:
        if value is not None and value != {}:
            spec(value, where)
    return check


def _both(first: Spec, second: Spec) -> Spec:
    def check(value: Any, where: str) -> None:
        first(value, where)
        second(value, where)
    return check


def _list(item: Spec, *, min_len: int = 0, max_len: int = MAX_ITEMS) -> Spec:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, list):
            _fail(where, f"expected a list, got {_shown(value)}")
        if not min_len <= len(value) <= max_len:
            _fail(where, f"{len(value)} items (expected {min_len} to {max_len})")
        for i, x in enumerate(value):
            item(x, f"{where}[{i}]")
    return check


def _map(value_spec: Spec, key_spec: Spec = _text) -> Spec:
    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, f"expected an object, got {_shown(value)}")
        if len(value) > MAX_ITEMS:
            _fail(where, f"{len(value)} entries (at most {MAX_ITEMS})")
        for k, v in value.items():
            key_spec(k, f"{where} key")
            value_spec(v, f"{where}[{_shown(k)}]")
    return check


def _object(required: dict[str, Spec], optional: dict[str, Spec] | None = None, *, extra: bool = False) -> Spec:
    """An object with these keys; `extra`: other keys are allowed and not read (informational parts)."""
    optional = optional or {}

    def check(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            _fail(where, f"expected an object, got {_shown(value)}")
        for key, spec in required.items():
            if key not in value:
                _fail(f"{where}.{key}", "missing")
            spec(value[key], f"{where}.{key}")
        for key, spec in optional.items():
            if key in value:
                spec(value[key], f"{where}.{key}")
        if not extra:
            unknown = sorted(set(value) - set(required) - set(optional))
            if unknown:
                _fail(where, f"unknown field {_shown(unknown[0])}")
    return check


_QUANT = _object({"scale": _positive, "zero_point": _integer(-(2**31), 2**31 - 1)})
TENSOR = _object(
    {"name": _text, "shape": _list(_integer(0, 2**31 - 1), max_len=32), "dtype": _literal(*DTYPES)},
    {"key": _text, "perm": _nullable(_list(_integer(0, 31), max_len=32)), "quant": _nullable(_QUANT),
     "valid_range": _nullable(_list(_integer(-(2**63), 2**63 - 1), min_len=2, max_len=2))},
)
SEGMENT = _object(
    {"id": _text, "device": _pattern(_DEVICE_ID, "a logical device id (cpu, edgetpu:0, gpu:0)"),
     "backend": _literal(*BACKENDS), "artifact": _path, "inputs": _list(TENSOR), "outputs": _list(TENSOR)},
    {"fallback_artifact": _nullable(_path), "nodes": _integer(0, 2**31 - 1), "predicted_ms": _number,
     "threads": _integer(0, 4096), "replica": _integer(0, 64)},
)
_IDS = _list(_list(_text))
# the informational parts: only what `edgesdk inspect` reads is typed; the rest is shown as it is
def _measured(value: Any, where: str) -> None:
    """A figure the build measured: a number, NaN included (a part whose int8 output is all NaN is
    published only with --accept-accuracy-loss, and says so)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(where, f"expected a number, got {_shown(value)}")


_ACCURACY = _object({}, {
    "samples": _integer(0, 2**31 - 1), "top1_agreement": _number, "held_out": _flag, "accepted_loss": _flag,
    "tensors": _map(_object({"cosine": _number, "max_abs_error": _number}, extra=True)),
    # the gate's record (bundling/gate.py): each output part's figures, the verdict, what failed and why
    "parts": _map(_object({"cosine": _measured, "mean_error": _measured, "max_error": _measured},
                          {"top1": _nullable(_measured), "kind": _text, "activation": _text}, extra=True)),
    "gate": _object({}, {"passed": _flag, "calibration": _text}, extra=True),
    "failures": _list(_object({"part": _text}, {"kind": _text, "missed": _map(
        _object({"value": _measured, "threshold": _measured}, extra=True))}, extra=True)),
    "culprits": _list(_object({"node": _text, "segment": _text, "op": _text, "added_error": _measured,
                               "added_snr_db": _measured, "cause": _text}, {"int8_op": _nullable(_text)}, extra=True)),
}, extra=True)
_EDGETPU = _object({}, {
    "edgetpu_compiled": _flag, "finish_command": _text, "co_compiled": _map(_list(_text)),
    "compiler": _map(_object({"on_chip_bytes": _number, "off_chip_bytes": _number,
                              "ops_on_tpu": _integer(0, 2**31 - 1)}, extra=True)),
    "corrections": _list(_object({"segment": _text, "ops": _integer(0, 2**31 - 1),
                                  "ops_on_tpu": _integer(0, 2**31 - 1), "ops_on_cpu": _integer(0, 2**31 - 1),
                                  "predicted_ms_before": _number, "predicted_ms_after": _number,
                                  "first_unmapped": _any, "status": _any, "first_cpu_node": _any}, extra=True)),
    "caches": _absent_or(_map(_object({"cached_bytes": _number, "capacity_bytes": _number, "streamed_bytes": _number},
                                      extra=True))),
    "cache_corrections": _nullable(_list(_object({"segment": _text, "streamed_share": _number,
                                                  "predicted_ms_before": _number, "predicted_ms_after": _number},
                                                 extra=True))),
}, extra=True)
# the tune stage's choice of each CPU span's backend, as `edgesdk inspect` reads it: measured (each
# candidate's ms, measured_on names the host; an int8 one's accuracy gate) or, where the target's CPU
# cannot be timed, by policy (measured_on null, each candidate's policy or why it was skipped)
_GATE = _object({"cosine": _number}, {"top1": _nullable(_number), "samples": _integer(0, 2**31 - 1)}, extra=True)


def _measured_spans_list_candidates(value: Any, where: str) -> None:
    """A span chosen by measurement lists its candidates (`inspect` shows each one's time)."""
    if value.get("measured_on") is not None:
        for i, span in enumerate(value.get("spans", ())):
            if "candidates" not in span:
                _fail(f"{where}.spans[{i}].candidates", "missing (the span was chosen by measurement)")


_CPU_SELECTION = _both(_object({}, {
    "measured_on": _nullable(_text), "note": _text, "candidates": _list(_text),
    "precision": _literal("fp32", "bf16", "fp16", "int8", "auto"), "precisions_not_offered": _map(_text),
    "target_cpu": _object({"mcpu": _text, "features": _list(_text)}),
    "reference": _text,  # what the spans' candidates were checked against, where not onnxruntime on the model
    "gate": _object({"cosine": _number, "top1": _number, "calibration_samples": _integer(0, 2**31 - 1),
                     "held_out_samples": _integer(0, 2**31 - 1)}, extra=True),
    "spans": _list(_object({"segments": _list(_text, min_len=1), "chosen": _text}, {
        "nodes": _integer(0, 2**31 - 1), "why": _text,
        "within_noise": _object({"runner_up": _text, "margin": _number, "noise": _number}),
        "check_tolerance": _object({"rounding_floor": _number, "tolerance": _number}),
        "settled": _object({"candidates": _list(_text), "rounds": _integer(0, 2**31 - 1)}),
        "replay_refuted": _object({"candidate": _text, "cached_ms": _number, "now_ms": _nullable(_number),
                                   "runner_up": _text, "runner_up_ms": _number, "margin": _number}, {"failed": _text}),
        "candidates": _map(_object({}, {"ms": _number, "spread": _number, "skipped": _text, "gate": _GATE, "policy": _text,
                                        "mixed": _object({"float_ops": _any, "ops": _any}, extra=True)},
                                   extra=True))}, extra=True)),
}, extra=True), _measured_spans_list_candidates)
_TUNING = _object({}, {"cpu_selection": _CPU_SELECTION}, extra=True)


def _nonnegative(value: Any, where: str) -> None:
    _number(value, where)
    if value < 0:
        _fail(where, f"expected a number of at least 0, got {_shown(value)}")


# the self-test reads these to judge the bundle, so each is typed: a bound in the tensor's own unit, the
# int8 steps it allows, an activation an int8 difference is carried through, a bound on the mean error
def _carried_in_steps(value: Any, where: str) -> None:
    """A difference carried through an activation is counted in int8 steps of a tensor of known step."""
    if "activation" in value:
        for key in ("lsb", "scale"):
            if key not in value:
                _fail(f"{where}.{key}", "missing (the tolerance is carried through an activation)")


_TOLERANCE = _both(_object({"abs": _nonnegative, "reason": _text}, {
    "rule": _text, "lsb": _integer(0, 1 << 20), "scale": _positive, "mean_abs": _nonnegative,
    "activation": _object({"op": _literal("LOGISTIC", "TANH", "SOFTMAX"), "input_scale": _positive},
                          {"input": _text})}),
    _carried_in_steps)
_GOLDEN = _object({}, {"tensors": _map(_TOLERANCE), "outputs": _map(_TOLERANCE), "method": _text})


def _auto_plan_complete(value: Any, where: str) -> None:
    """A plan chosen under a latency budget states the budget, and its prediction beside the dense time."""
    if value.get("source") == "auto":
        for key in ("budget_ms", *(("predicted_ms",) if "dense_ms" in value else ())):
            if key not in value:
                _fail(f"{where}.{key}", "missing (the plan was chosen under a budget)")


# --prune's summary ({}: not pruned): its method, sparsity and fidelity, as `edgesdk inspect` reads them
_PRUNING = _absent_or(_object(
    {"method": _text, "layers": _integer(0, 2**31 - 1), "sparsity": _number},
    {"corrected": _flag, "sparse_kernels": _integer(0, 2**31 - 1), "accelerator_layers_dense": _list(_text),
     "fidelity": _absent_or(_object({}, {"end_to_end": _absent_or(_map(_object(
         {"cosine": _number, "max_error_of_scale": _number}, {"top1_agreement": _nullable(_number)}, extra=True)))},
         extra=True)),
     "accuracy": _absent_or(_object({"labels": _any, "top1": _object(
         {"dense": _number, "pruned": _number}, {"corrected": _number}, extra=True)}, extra=True)),
     "plan": _absent_or(_both(_object({}, {"source": _text, "budget_ms": _number, "dense_ms": _number,
                                           "predicted_ms": _number, "measured_ms": _number}, extra=True),
                              _auto_plan_complete))},
    extra=True))
MANIFEST = _object(
    {"schema_version": _integer(0, 2**31 - 1), "sdk_version": _text,
     "min_runtime_version": _pattern(_VERSION, "a version like 0.1.0"),
     "model": _object({"name": _text}, {"sha256": _text}, extra=True),
     "target": _object({"name": _text}, {"description": _text}, extra=True),
     "arch": _literal(*ARCHES), "device_map": _map(_text),
     "inputs": _list(TENSOR), "outputs": _list(TENSOR, min_len=1), "segments": _list(SEGMENT, min_len=1),
     "pipeline_stages": _IDS},
    {"predicted": _map(_number), "parallel_steps": _IDS, "replicas": _IDS, "cpu_threads": _integer(0, 4096),
     "toolchain": _map(_text), "calibration": _object({}, extra=True), "edgetpu": _EDGETPU,
     "accuracy": _ACCURACY, "golden": _GOLDEN, "tuning": _TUNING, "warnings": _list(_text),
     "pruning": _both(_object({}, extra=True), _PRUNING),
     "files": _map(_object({"sha256": _pattern(_SHA256, "a sha256 in hex"), "size": _integer(0, 2**53)}),
                   key_spec=_path),
     "bundle_version": _integer(0, MAX_BUNDLE_VERSION),
     "signing": _object({}, {"algorithm": _literal("ed25519"),
                             "key_id": _pattern(re.compile(r"^[0-9a-f]{16}$"), "a key id (16 hex characters)")}),
     "provenance": _object({}, extra=True)},
)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _check_references(d: dict[str, Any]) -> None:
    """What the types cannot say: ids defined once and named where defined, tensors produced before
    they are taken, layouts that are permutations, index ranges that are ranges."""
    ids = [s["id"] for s in d["segments"]]
    if len(set(ids)) != len(ids):
        _fail("manifest.segments", f"segment id {_shown(next(i for i in ids if ids.count(i) > 1))} is used twice")
    for field_name in ("pipeline_stages", "parallel_steps", "replicas"):
        for i, step in enumerate(d.get(field_name, ())):
            for sid in step:
                if sid not in ids:
                    _fail(f"manifest.{field_name}[{i}]", f"names segment {_shown(sid)}, which the manifest does not define")
    available = {t["name"] for t in d["inputs"]}
    tensors = [(f"manifest.{part}[{i}]", t) for part in ("inputs", "outputs") for i, t in enumerate(d[part])]
    for k, seg in enumerate(d["segments"]):
        where = f"manifest.segments[{k}]"
        for t in seg["inputs"]:
            if t["name"] not in available:
                _fail(f"{where}.inputs", f"takes {_shown(t['name'])}, which no model input or earlier segment gives")
        if seg["backend"] == "tvm":  # the runner passes arguments in the order of their integer keys
            keys = [t.get("key", "") for t in (*seg["inputs"], *seg["outputs"])]
            if not all(re.fullmatch(r"[0-9]{1,4}", k) for k in keys):
                _fail(where, "a TVM segment's tensors have integer keys (their argument positions)")
        available |= {t["name"] for t in seg["outputs"]}
        tensors += [(f"{where}.{part}[{i}]", t) for part in ("inputs", "outputs") for i, t in enumerate(seg[part])]
    for i, t in enumerate(d["outputs"]):
        if t["name"] not in available:
            _fail(f"manifest.outputs[{i}]", f"{_shown(t['name'])} is produced by no segment")
    for where, t in tensors:
        if t.get("perm") is not None and sorted(t["perm"]) != list(range(len(t["shape"]))):
            _fail(f"{where}.perm", f"{t['perm']} is not a permutation of the tensor's {len(t['shape'])} axes")
        if t.get("valid_range") is not None and t["valid_range"][0] > t["valid_range"][1]:
            _fail(f"{where}.valid_range", f"{t['valid_range']} is empty")
