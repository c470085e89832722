"""The build side's backends by name: what a stage needs to know of one without importing it.

A plan segment names its backend (`plan.json`: "tvm", "tflite", "onnxruntime"); the stages ask the
registry what that backend does instead of comparing names: the tune stage has the segments of a
backend that `tunes` searched by it (`Backend.tune`: a `TuneJob` per device kind) and, for an auto pruning
plan, layers timed by one that names a `layer_timer` (`Backend.time_layers`), the compress stage
has those of one that `quantizes` converted by it (`Backend.quantize`: a `QuantizeJob` per segment),
the package stage has each segment compiled by its backend (`Backend.compile`: a `CompileJob` in, a
`Compiled` out) and then finished by its device kind's `Finisher`, where one is registered (Coral's
`edgetpu_compiler` for the Edge TPU); the tune stage measures each CPU span on the backends that say where
they stand among its candidates (`cpu_order`: `cpu_candidates`), and where it cannot measure tries the one
marked `cpu_policy` (`policy_fallback`); a bundle's requirements.txt lists each used backend's
`runtime_dists`, in `rank` order. MetaSchedule's string-keyed roles are the model. Registering here
imports nothing heavy: every entry point is named as "module:function" and imported when it is
first called, and compiler and runtime libraries stay imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from ..errors import UsageError

# the precisions a CPU candidate may compute in below float32, each admitted only behind the accuracy gate
REDUCED = ("bf16", "fp16", "int8")
from ..runtime.manifest import TensorSpec


# In a device kind's tuning database: kernel times a backend measured to choose between its own kernels
# (TVM: a pruned convolution's sparse or dense kernel), so that the tune stage's measurement and the package
# stage's compilation choose alike; like the tune stage's timing cache, left out of the database's digest.
KERNEL_TIMES = "kernel_times.json"


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
    # the backend may add the kernel times it measures to the tuning database (KERNEL_TIMES): the tune stage's
    # candidates do, so that the package stage, reading the tune stage's copy, replays them
    keep_kernel_times: bool = False
    # the imported model's own file where the import kept one (a quantized TFLite, `frontends.OWN_TFLITE`): what a
    # backend that ships the model as given (`litert-own`) copies
    source: Path | None = None


@dataclass(frozen=True)
class LayerTimesJob:
    """Layers of a model to time alone on this host, dense and with pruned weights (a per-layer pruning
    plan's times: compression/plan.py), and sets of CPU segments to time whole (the dense ones, a plan's)."""

    model: Any  # the whole model (onnx.ModelProto), for the layers' shapes
    weights: dict  # each layer's output name -> {method: its pruned weight (numpy)}
    segments: dict  # a name -> CPU segment models (onnx.ModelProto), timed whole and summed
    device: Any  # the target's CPU entry
    tuning_db: Path  # the CPU's tuning database: its records schedule what is timed; its KERNEL_TIMES keeps times
    log: Callable[[str], None]


@dataclass(frozen=True)
class Compiled:
    artifact: str  # relative to the bundle root
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    fallback_artifact: str | None = None  # what the CPU runs when the accelerator is missing
    twin: Path | None = None  # the twin for the build host's golden run
    tuned: dict | None = None  # where the kernels' schedules came from (the manifest's tuning.segments)
    device_needs: tuple[str, ...] = ()  # comment lines for requirements.txt: what else the device must have


@dataclass(frozen=True)
class Boards:
    """The boards registered with a TVM RPC tracker under `key`, where a tuning backend measures its
    candidates instead of on this host (`--rpc-tracker HOST:PORT --rpc-key KEY`)."""

    host: str
    port: int
    key: str
    session_timeout_s: float = 60.0  # one candidate's upload, run and cleanup on a board

    @staticmethod
    def parse(tracker: str, key: str) -> "Boards":
        """`HOST:PORT` and a key; a malformed address is a usage error."""
        host, sep, port = tracker.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(
                "tune.rpc-address", f"--rpc-tracker {tracker!r} is not HOST:PORT", hint="e.g. --rpc-tracker 127.0.0.1:9190"
            )
        if not key:
            raise UsageError("tune.rpc-key", "--rpc-tracker needs --rpc-key, the key the boards registered with",
                             hint="the key given to `python -m tvm.exec.rpc_server --key KEY` on each board")
        return Boards(host, int(port), key)

    def __str__(self) -> str:
        return f"{self.key}@{self.host}:{self.port}"


@dataclass(frozen=True)
class TuneJob:
    """The segments of one device kind for a backend to search kernels for, within a budget."""

    kind: str  # the device kind (its database and logs are its own)
    models: tuple  # the segments' ONNX graphs (onnx.ModelProto), in plan order
    device: Any  # the target's entry for the kind (a TVM backend reads its codegen)
    tuning_db: Path  # the kind's database directory; records are appended as they are measured
    trials: int  # the budget over the kind's segments
    time_budget_s: float | None  # wall time left for this kind, None for no limit
    seed: int
    boards: Boards | None  # measure on these boards instead of this host
    log_dir: Path
    progress: Callable[[Any], None] | None
    log: Callable[[str], None]


@dataclass(frozen=True)
class AccuracyTarget:
    """What a quantized CPU segment must keep of the float model's outputs (the tune stage's accuracy
    gate, `ir.numeric.fidelity`): each output's cosine similarity over the samples at least `cosine`;
    for those of `class_outputs` that hold class scores, the arg max agreeing on at least `top1`."""

    cosine: float
    top1: float
    class_outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class QuantizeJob:
    """One plan segment for a backend to convert to a quantized model with calibration samples."""

    segment: Any  # the plan's segment
    model: Any  # its float ONNX graph
    samples: list  # per calibration sample, the segment's inputs and the float model's values of its outputs
    out_dir: Path  # the compress stage's segments/ directory: the artifact goes here
    method: str  # minmax, percentile, mse, entropy or auto (--calib-method; ir/calibrators.py)
    percentile: float
    log: Callable[[str], None]
    # mixed precision, for a backend that can keep ops float (LiteRT int8 on the CPU; never the Edge
    # TPU's, which takes int8 only): with `target`, the fewest ops float that meet it on the samples;
    # `keep_float` names them instead (an earlier search's answer, replayed). Neither: full int8.
    target: AccuracyTarget | None = None
    keep_float: tuple[str, ...] | None = None
    # with method auto, a backend that can: each candidate it weighed written too, in the record's
    # `alternatives` (label -> artifact, tensor specs, accuracy), for the compress stage to weigh by the
    # whole model's outputs
    alternatives: bool = False
    # the segment's outputs (by name) that the user's code reads through an activation (sigmoid, softmax):
    # a backend that can spends their int8 steps where the activation moves
    activations: Mapping[str, str] = field(default_factory=dict)
    # the segment's inputs that are the model's own: their range is every value the samples hold (min-max)
    model_inputs: tuple[str, ...] = ()
    # tensors (by name) the imported model had quantized itself, with its grid's float range
    # (legalization/quantized.py): a backend that can rounds them on that grid, as the model did
    grids: Mapping[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class LayersJob:
    """A quantized segment to run on `feeds` with every intermediate tensor kept: the int8 side of the
    culprit search (compression/culprits.py)."""

    model: Any  # the float segment (onnx.ModelProto) the quantizer converted
    artifact: Path  # the quantized artifact
    record: dict  # the quantizer's record of it (its tensor specs: "inputs", "outputs")
    feeds: list  # per sample, the segment's inputs by ONNX name


@dataclass(frozen=True)
class FinishJob:
    """A compiled segment for its device kind's own compiler to finish, inside the bundle."""

    bundle: Path
    artifact: str  # relative to the bundle: what the backend compiled
    segment: Any  # the plan's segment


@dataclass(frozen=True)
class Finished:
    artifact: str  # what ships, relative to the bundle
    record: dict  # what the compiler said (the manifest keeps it)
    partial: Any = None  # the compiler's mapping where it maps only part of the segment, for re-costing


@dataclass(frozen=True)
class Finisher:
    """A device kind's own compiler, run on its segments' artifacts after their backend compiled them.
    Without it installed, the bundle ships the artifacts unfinished and the build says how to finish them.

    `module` implements it: `finish(FinishJob) -> Finished`; optionally `finish_group(jobs) -> [Finished]`,
    the artifacts bound for one device instance compiled together in the order given (Coral's
    co-compilation: they share its parameter cache); `find()`, the tool's path or None where it is not
    installed; `unfinished_warning(artifacts)`, the build's warning when it is not, with the command
    that finishes them later; `finish_command(artifacts)`, that command (`finish_group_command(groups)`
    where it compiles groups); `describe(correction)`, the build's warning for a segment it maps only
    in part (`scheduling.correction`)."""

    kind: str  # the device kind whose segments it finishes
    name: str  # the tool
    module: str  # the module implementing it

    def _call(self, function: str, *args):
        return getattr(importlib.import_module(self.module), function)(*args)

    def run_group(self, jobs: list[FinishJob]) -> list[Finished]:
        """The jobs of one device instance, together where the module compiles groups, else one by one."""
        module = importlib.import_module(self.module)
        if hasattr(module, "finish_group"):
            return module.finish_group(jobs)
        return [module.finish(j) for j in jobs]

    def group_command(self, groups: list[list[str]]) -> str:
        """The command that finishes `groups` (each one instance's artifacts, in order) later."""
        module = importlib.import_module(self.module)
        if hasattr(module, "finish_group_command"):
            return module.finish_group_command(groups)
        return module.finish_command([a for g in groups for a in g])

    def available(self) -> bool:
        return self._call("find") is not None

    def finish_command(self, artifacts: list[str]) -> str:
        return self._call("finish_command", artifacts)

    def unfinished_warning(self, artifacts: list[str], command: str | None = None) -> str:
        return self._call("unfinished_warning", artifacts, *([command] if command else []))

    def describe(self, correction: dict) -> str:
        return self._call("describe", correction)


@dataclass(frozen=True)
class Backend:
    name: str  # what plan.json's segments say
    runner: str  # the runtime's runner of its artifacts (runtime/backends), what the manifest says
    rank: int  # the order of its lines in a bundle's requirements.txt
    runtime_dists: tuple[str, ...]  # the PyPI distributions a device needs to run its artifacts
    compiler: str = ""  # "module:function" taking a CompileJob, returning a Compiled
    tuner: str = ""  # "module:function" taking a TuneJob, returning its summary; "" where it does not tune
    quantizer: str = ""  # "module:function" taking a QuantizeJob, returning its record; "" where it does not
    # for a backend that quantizes: "module:function" taking a LayersJob, returning per ONNX tensor the
    # quantized model's values and its int8 range there (backends/tflite/layers.py says what); "" where
    # its artifacts cannot be inspected layer by layer (the culprit search then skips its segments)
    layers: str = ""
    # "module:function" (node, shapes, consts) -> why it cannot lower the node, or None: what legalize asks
    # of a device's backends, and which backends the tune stage may measure for a CPU span
    lowering: str = ""
    # for a backend that tunes: "module:function" (models, device, tuning_db) -> why the database does not
    # hold tuned records for every function of these segments, or None: the tune stage's policy where it
    # cannot time the target's CPU
    coverage: str = ""
    # for a backend with sparse kernels: "module:function" taking a LayerTimesJob, returning {"segments_ms": {name:
    # the summed time of those segments}, "layers": {output: {"dense_ms": ..., "sparse_ms": {method: ...}}}} for the
    # layers it times (the others absent); what `--prune-plan auto` chooses by
    layer_timer: str = ""
    # bumped whenever what `compiler` makes of a graph, or how the runtime's runner runs it, changes: the
    # tune stage's timing cache keys on it, so a candidate timed the old way is measured anew, not replayed
    revision: int = 0
    # what its compiler holds while it compiles a segment, beyond the build's own copies of the model: a
    # fixed part and bytes per byte of the segment's weights (measured, benchmarks/results/build-memory.json); the build's
    # memory estimate (`stages/memory.py`) is made of these
    compile_base_bytes: int = 0
    compile_bytes_per_weight_byte: float = 1.0
    # where a file format bounds a segment's weights (a FlatBuffer's 2 GiB): the most it compiles; 0: no bound
    max_weight_bytes: int = 0
    # a candidate the tune stage measures for a CPU span (`scheduling/selection.py`, `cpu_candidates`): its place
    # in the order ties are broken in (None: never a candidate), and the precision it computes in (REDUCED): a
    # "bf16", "fp16" or "int8" one is measured with `--cpu-precision` of that precision (or auto) where its float
    # twin `variant_of` is allowed, and admitted only behind the accuracy gate
    cpu_order: int | None = None
    precision: str = "fp32"
    variant_of: str = ""
    # where the target's CPU cannot be timed here: the backend a whole span is tried on by policy (`policy_fallback`)
    cpu_policy: bool = False

    @property
    def tunes(self) -> bool:
        """The tune stage searches its segments' kernels."""
        return bool(self.tuner)

    @property
    def quantizes(self) -> bool:
        """The compress stage converts its segments with calibration data."""
        return bool(self.quantizer)

    def compile(self, job: CompileJob) -> Compiled:
        return _function(self.compiler, f"backend {self.name!r} names no compiler")(job)

    def tune(self, job: TuneJob) -> dict:
        return _function(self.tuner, f"backend {self.name!r} names no tuner")(job)

    def quantize(self, job: QuantizeJob) -> dict:
        return _function(self.quantizer, f"backend {self.name!r} names no quantizer")(job)

    def int8_layers(self, job: LayersJob) -> dict:
        return _function(self.layers, f"backend {self.name!r} names no layer inspection")(job)

    def time_layers(self, job: LayerTimesJob) -> dict:
        return _function(self.layer_timer, f"backend {self.name!r} names no layer timer")(job)

    def lowering_check(self) -> Callable[..., str | None]:
        return _function(self.lowering, f"backend {self.name!r} names no lowering check")

    def untuned(self, models: tuple, device: Any, tuning_db: Path) -> str | None:
        """Why the segments' `models` would compile without tuned records for all of their functions
        (None when every one has them); a backend that names no coverage check is never tuned."""
        if not self.coverage:
            return f"{self.name} is not tuned"
        return _function(self.coverage, "")(models, device, tuning_db)


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


def cpu_candidates(precision: str = "fp32") -> list[str]:
    """The backends the tune stage measures for a CPU span at `precision`, in the order ties are broken."""
    found = [b for b in _BACKENDS.values() if b.cpu_order is not None and b.precision == precision]
    return [b.name for b in sorted(found, key=lambda b: (b.cpu_order, b.name))]


def variant(name: str, precision: str) -> str | None:
    """The candidate measured beside the fp32 candidate `name` in reduced `precision` ("bf16", "int8"), if any."""
    return next((b.name for b in backends() if b.variant_of and b.variant_of == name and b.precision == precision
                 and b.cpu_order is not None), None)


def policy_fallback() -> str | None:
    """The backend a whole CPU span is tried on where the target's CPU cannot be timed here."""
    return next((b.name for b in backends() if b.cpu_policy), None)


_FINISHERS: dict[str, Finisher] = {}


def register_finisher(finisher: Finisher) -> Finisher:
    if finisher.kind in _FINISHERS:
        raise ValueError(f"device kind {finisher.kind!r} already has a finisher ({_FINISHERS[finisher.kind].name})")
    _FINISHERS[finisher.kind] = finisher
    return finisher


def unregister_finisher(kind: str) -> None:
    _FINISHERS.pop(kind, None)


def finisher(kind: str) -> Finisher | None:
    """The compiler that finishes the segments of device kind `kind`, or None where its backend's
    artifacts ship as they are."""
    return _FINISHERS.get(kind)
