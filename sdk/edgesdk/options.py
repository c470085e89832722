"""The build's options, each declared once: its type, default, the stage that reads it, and how the command
line spells it (flag, help). `BuildOptions` is what the pipeline runs with; `edgesdk build` and the commands
that share its options generate their parameters from these fields (cli.py `_with_options`), and the Python
API (api.py) takes them as keywords, so a new option is one field here and, where its command-line spelling
needs parsing, one entry in option_values.py's `SPELLINGS`. Options that must go together are checked there
(`checked_together`): the CLI and the API refuse the same values with the same errors.

A choice is a `Literal` type: the command line refuses any other value as it reads it, with the field's
`Refusal` (exit 2), and the pipeline refuses it alike from a Python caller (`check_choice`).

This module imports nothing heavy and nothing of typer: a Python caller builds a `BuildOptions` directly.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from .errors import UsageError

StageName = Literal["import", "legalize", "schedule", "tune", "compress", "package"]  # pipeline.PHASE_NAMES
Mode = Literal["latency", "throughput"]
CalibMethod = Literal["minmax", "percentile", "mse", "entropy", "auto"]  # ir/calibrators.py METHODS, and auto
CpuPrecision = Literal["fp32", "bf16", "fp16", "int8", "auto"]
SparseKernels = Literal["measured", "sparse", "dense"]
Task = Literal["classification", "detection", "ocr", "segmentation", "generic"]  # compression/tasks.py
Decoder = Literal["yolov8", "yolov5", "ssd"]

GENERAL = "general"  # an option no single stage owns (the output, the seed, where the build stops)
# The panels of `edgesdk build --help`, in this order: each stage's options, then the general ones.
PANELS = {"import": "Stage 1: import", "legalize": "Stage 2: legalize", "schedule": "Stage 3: schedule",
          "tune": "Stage 4: tune", "compress": "Stage 5: compress (int8 calibration, pruning)",
          "package": "Stage 6: package (accuracy, evaluation, signing)", GENERAL: "Output and general"}


@dataclass(frozen=True)
class Refusal:
    """What a value outside a choice field's `Literal` gets: UsageError(code, `FLAG VALUE: <says>`, hint),
    exit 2. In `says` and `hint`, {all} is the choices joined by ', ' and {either} is 'a, b or c'."""

    code: str
    hint: str
    says: str = "expected one of {all}"


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line."""

    stage: str | None  # the stage that owns it (its panel in --help), GENERAL, or None: the command's own panel
    help: str  # plain text: cli.py escapes what rich would read as markup
    names: tuple[str, ...] = ()  # default: --field-name
    spelled: Any = None  # the command line's type where it differs from the field's (cli.py parses it)
    negated: bool = False  # a flag that sets a field whose default is True to False (--no-rewrites)
    argument: bool = False  # positional
    min: float | None = None
    refusal: Refusal | None = None  # a choice field's

    def flags(self, name: str) -> tuple[str, ...]:
        return self.names or ("--" + name.replace("_", "-"),)


def _option(default: Any = MISSING, *, factory: Any = MISSING, **flag: Any) -> Any:
    return field(default=default, default_factory=factory, metadata={"flag": Flag(**flag)})


@dataclass(frozen=True)
class BuildOptions:
    """What a build runs with. Each field the command line sets declares its `Flag` (cli.py makes the
    typer parameter from it); the stages read the fields they name in their OPTIONS."""

    model: Path = _option(
        stage=None, argument=True, help="The model: .onnx, .keras, .h5, .tflite, or a SavedModel directory.")
    target: str = _option(
        stage=None, names=("--target", "-t"),
        help="A target file or a shipped target's name (edgesdk targets list).")
    out: Path = _option(
        stage=None, names=("--out", "-o"),
        help="Output directory: DIR/bundle, DIR/bundle.tar.gz, DIR/.build (stage cache).")
    input_shapes: dict[str, tuple[int, ...]] = _option(
        factory=dict, stage="import", names=("--input-shape",), spelled=list[str],
        help="Fix an input's shape: NAME=1x3x224x224 (repeatable).")
    input_values: dict[str, tuple[float, ...]] = _option(
        factory=dict, stage="import", names=("--input-value",), spelled=list[str],
        help="Freeze an input to a constant: NAME=16000 or NAME=1,2,3 (repeatable); the input leaves the bundle's "
             "signature.")
    batch: int = _option(1, stage="import", min=1, help="Batch size for inputs whose first dimension is dynamic.")
    trials: int = _option(
        0, stage="tune", min=0,
        help="MetaSchedule trials (measured candidates) per device kind (CPU, GPU) of the model; 0: no search, the "
             "tuning database's records are applied.")
    time_budget: float | None = _option(  # seconds of tuning at most (the tune stage's wall time)
        None, stage="tune", spelled=str | None,
        help="Stop tuning after this long: 90s, 20m, 1.5h or seconds; the next build with the same --trials resumes.")
    tuning_db: Path | None = _option(
        None, stage="tune", help="Tuning database directory [default: ~/.cache/edgesdk/tuning/TARGET].")
    rpc_tracker: str | None = _option(
        None, stage="tune",
        help="HOST:PORT of a TVM RPC tracker: tuning measures candidates on the boards registered with it, and a "
             "foreign CPU's backends are timed there (boards run `python -B -m runtime.board`).")
    rpc_key: str | None = _option(None, stage="tune", help="With --rpc-tracker: the key the boards registered with.")
    calib: Path | None = _option(
        None, stage="compress",
        help="Directory of calibration samples for int8: .npy / .npz files, or images (PNG, JPEG, BMP).")
    calib_samples: int = _option(32, stage="compress", min=1, help="Calibration samples to use at most.")
    # None: `calibration_method()` chooses
    calib_method: CalibMethod | None = _option(
        None, stage="compress",
        refusal=Refusal("cli.bad-calib-method", "auto chooses per tensor among minmax, percentile, mse and entropy "
                        "by measured error; see docs/calibration.md"),
        help="How int8 activation ranges are chosen: minmax (the values' min and max), percentile "
             "(--calib-percentile), mse (least squared error through int8), entropy (TensorRT's KL), or auto (per "
             "tensor the method of least measured error) [default: auto with --calib, minmax on synthetic samples].")
    calib_percentile: float = _option(
        99.99, stage="compress",
        help="With --calib-method percentile (and auto): the percentile kept in each tail, in (50, 100].")
    calib_preprocess: str | None = _option(  # ir/calibration.py
        None, stage="compress",
        help="How --calib images become inputs: KEY=VALUE,... of color (RGB, BGR, GRAY), scale (1/255), mean, std "
             "(per channel joined by ':'), layout (NCHW, NHWC); input = (pixel * scale - mean) / std. Without "
             "--calib, the range it gives 8-bit pixels is the image input's range for synthetic samples.")
    input_ranges: dict[str, tuple[float, float]] = _option(
        factory=dict, stage="compress", names=("--input-range",), spelled=list[str],
        help="Without --calib: the range an input's synthetic calibration samples are drawn from, NAME=LOW,HIGH "
             "(repeatable), e.g. x=0,1 for images in [0, 1] [default: the range --calib-preprocess or the model's "
             "metadata states, else -1,1 with a warning].")
    max_abs_error: float | None = _option(  # None: the target's
        None, stage="legalize", min=0.0,
        help="Bound on each ReLU-sum approximation's error [default: the target's legalize.max_abs_error].")
    # the bound in int8 steps of each approximated output (its range on the calibration data / 255); None:
    # max_abs_error alone. Given both, each approximation keeps the tighter
    max_error_lsb: float | None = _option(
        None, stage="legalize", min=0.0,
        help="Bound on each approximation's error in int8 steps of its output (the output's calibrated range / "
             "255), e.g. 0.5; with --max-abs-error too, the tighter of the two.")
    # a function no ReLU sum approximates within the bound stays exact, on the CPU, with a warning: the plan
    # then costs it there as any op an accelerator lacks; --no-cpu-fallback makes that an error instead
    allow_cpu_fallback: bool = _option(
        True, stage="legalize", names=("--no-cpu-fallback",), negated=True,
        help="Fail when no approximation of a function meets the bound, instead of keeping the function exact on "
             "the CPU (with a warning).")
    legalize_rewrites: bool = _option(  # False: legalize only annotates
        True, stage="legalize", names=("--no-rewrites",), negated=True,
        help="Legalize rewrites nothing: ops an accelerator refuses run on the CPU (to compare).")
    mode: Mode = _option(
        "latency", stage="schedule",
        refusal=Refusal("cli.bad-mode", "see edgesdk build --help", says="expected {either}"),
        help="latency: one inference as fast as possible; throughput: pipeline a stream.")
    inter_op: bool = _option(
        True, stage="schedule", names=("--no-inter-op",), negated=True,
        help="Never run independent CPU operators concurrently (no inter-operator parallelism), to compare.")
    # the backends a whole CPU span is measured on beside the plan's cut; None: all; ("planned",): none
    cpu_backends: tuple[str, ...] | None = _option(
        None, stage="tune", spelled=str | None,
        help="The backends each whole CPU span is measured on beside the schedule's own cut, the fastest chosen: a "
             "comma-separated subset of tvm,onnxruntime,litert,openvino [default: all]; 'planned': the schedule's cut, "
             "nothing measured.")
    cpu_precision: CpuPrecision | None = _option(  # None: the target's CPU `precision`
        None, stage="tune",
        refusal=Refusal("cli.bad-cpu-precision", "bf16, fp16 and int8 measure CPU candidates in that precision behind "
                        "an accuracy gate, auto all three; fp32 keeps the CPU float", says="expected {either}"),
        help="fp32: every CPU segment float32; bf16: also measure bfloat16 candidates (OpenVINO's), where the "
             "target's CPU has AVX512_BF16 or AMX; fp16: float16 ones (OpenVINO's), where it has AVX512-FP16; int8: "
             "int8 candidates (LiteRT's int8 kernels, with the ops full int8 hurts most kept float where needed, "
             "and onnxruntime's); auto: all three. A reduced-"
             "precision candidate is admitted only where it passes the accuracy gate against fp32 on held-out "
             "calibration samples, and the fastest admitted wins [default: the target's CPU precision, fp32].")
    prune: str | None = _option(  # compression/prune.py
        None, stage="compress",
        help="Prune the CPU segments' convolution and matrix weights: 2:4 or 1:4 (N of every M input channels "
             "kept), magnitude:S (the smallest share S of each layer's weights, e.g. magnitude:0.75), "
             "column-combine[:G] (one input channel of every G kept per output channel, G=4 by default). Without "
             "retraining: the build reports the pruned model's fidelity to the dense one; pruned convolutions run "
             "sparse TVM kernels where measured faster.")
    prune_layers: str | None = _option(  # None: all but the first and last
        None, stage="compress",
        help="With --prune: the layers to prune, node names or globs joined by ',' or 'all' [default: all but the "
             "first and last].")
    prune_correct: bool = _option(
        False, stage="compress",
        help="With --prune: refit each pruned layer's kept weights by least squares to the dense layer's outputs on "
             "the calibration data.")
    sparse_kernels: SparseKernels = _option(
        "measured", stage="compress",
        refusal=Refusal("cli.bad-sparse-kernels", "measured chooses per layer by timing both kernels; sparse or "
                        "dense forces one", says="expected {either}"),
        help="With --prune: how a pruned convolution is computed on the CPU: measured (the sparse kernel where it is "
             "timed faster than the dense one on this host; by policy where the target's CPU cannot be timed "
             "here), sparse or dense (forced, to compare).")
    prune_plan: str | None = _option(  # "auto" (with latency_budget) or a plan file (compression/plan.py)
        None, stage="compress",
        help="Prune layer by layer: 'auto' chooses each layer's method among --prune's (a list, e.g. 2:4,1:4, the "
             "default) or dense, by dynamic programming over its kernels' times measured on this host and its "
             "sensitivity, the least fidelity loss within --latency-budget; or a plan file (a build's "
             "OUT/.build/4-tune/prune_plan.json) to prune exactly as it says.")
    latency_budget: float | None = _option(  # milliseconds
        None, stage="compress", min=0.0,
        help="With --prune-plan auto: the model's CPU time per inference on this host, in milliseconds, as the "
             "build runs it: nothing is pruned where the dense model meets it on a CPU backend the tune stage "
             "measures; else the plan must be predicted within it.")
    # held-out samples (labels optional): the bundle's task figures against the fp32 model (compression/tasks.py);
    # with --prune and labels.txt, also the pruned model's top-1 beside the dense one's
    eval_data: Path | None = _option(
        None, stage="package", names=("--eval",),
        help="A directory of held-out samples (as --calib reads them, in file-name order), with labels.txt where "
             "you have labels: the finished bundle is measured against the fp32 model on --task's own measure "
             "(docs/evaluation.md); with --prune and labels.txt of integer classes, also top-1 accuracy of the "
             "dense and the pruned model.")
    task: Task | None = _option(  # None: from the eval directory
        None, stage="package",
        refusal=Refusal("cli.bad-task", "classification, detection (with --decoder), ocr, segmentation or generic"),
        help="With --eval: classification (top-1/top-5), detection (with --decoder: boxes kept, lost, false at IoU "
             "0.5), ocr (CTC decoding: character accuracy), segmentation (mask IoU) or generic (per output cosine "
             "and error) [default: classification where DIR has labels.txt, else generic].")
    decoder: Decoder | None = _option(
        None, stage="package",
        refusal=Refusal("cli.bad-decoder", "yolov8: [1, 4+C, N]; yolov5: [1, N, 5+C]; ssd: a boxes and a scores "
                        "output"),
        help="With --task detection: yolov8 ([1, 4+C, N]), yolov5 ([1, N, 5+C]) or ssd (boxes and scores outputs, "
             "anchors given in --task-options).")
    task_options: str | None = _option(
        None, stage="package",
        help="With --task: KEY=VALUE,... e.g. score=0.25,iou=0.5,match=0.5 (detection), output=NAME, "
             "dictionary=FILE (ocr), threshold=0.5 (segmentation), goal=0.98 (the share of fp32's result to keep).")
    seed: int = _option(0, stage=GENERAL, help="Seed for every random choice (synthetic calibration, tuning).")
    # outputs given as logits that the user's code passes through sigmoid or softmax (by name): judged after it,
    # and calibrated where it moves (compression/accuracy.py `declared`)
    output_activations: dict[str, str] = _option(
        factory=dict, stage="compress", names=("--output-activation",), spelled=list[str],
        help="An output the model gives as logits that your code passes through an activation, NAME=sigmoid or "
             "NAME=softmax (repeatable), e.g. a detector's class logits: the accuracy gate judges it after the "
             "activation, and int8 spends its steps where the activation moves (a sigmoid's logits up to 8, from "
             "at least -8). The scores output of --decoder ssd with --task-options activation=sigmoid is declared "
             "so already.")
    # publish a bundle below the target's accuracy gate (the manifest says so)
    accept_accuracy_loss: bool = _option(
        False, stage="package",
        help="Publish the bundle even where it misses the target's accuracy gate (each output against fp32 on "
             "held-out samples, docs/accuracy.md); the manifest, edgesdk inspect and the build summary then say "
             "so.")
    # nodes no accelerator may run, kept in float on the CPU by the placement
    keep_on_cpu: tuple[str, ...] = _option(
        (), stage="schedule", spelled=list[str],
        help="Nodes no accelerator may run, by the model's own names joined by ',' (repeatable): the placement "
             "keeps them in float on the CPU, and plan.json states the predicted latency that costs. The accuracy "
             "gate's culprits are named so.")
    # below the gate, plan again with the culprits on accelerators kept on the CPU (`REMEDY_ROUNDS` at most)
    accuracy_remedy: bool = _option(
        True, stage="package", names=("--no-accuracy-remedy",), negated=True,
        help="Below the accuracy gate, fail at once: do not plan again with the culprit layers kept in float on "
             "the CPU (the default tries that, at most 3 rounds; docs/accuracy.md).")
    # the accuracy remedy's rounds so far (`build` sets it): per round, the gate's figures and the plan's
    # predicted latency before it, and the culprits it moved; recorded in plan.json's keep_on_cpu
    remedy: tuple[dict, ...] = ()
    low_memory: bool = _option(  # stages/memory.py
        False, stage="tune",
        help="Build in less memory: the CPU segments are compiled by onnxruntime alone (which reads the weights "
             "where they are), none by TVM or LiteRT, whose compilers hold the weights about 2 and 4 times over; "
             "the bundle may run slower. The build estimates its peak memory after import and again after "
             "schedule, and stops if this machine lacks it.")
    until: StageName | None = _option(
        None, stage=GENERAL, help="Stop after this stage.",
        refusal=Refusal("build.bad-stage", "stages, in order: {all}", says="no such stage"))
    start: StageName | None = _option(
        None, stage=GENERAL, names=("--from",), help="Rerun from this stage even if the cache is valid.",
        refusal=Refusal("build.bad-stage", "stages, in order: {all}", says="no such stage"))

    def calibration_method(self) -> str:
        """--calib-method, else auto where real calibration data is given and minmax on synthetic samples
        (whose ranges say little of real inputs, so measuring which method fits them best says little too)."""
        return self.calib_method or ("auto" if self.calib is not None else "minmax")

    def value(self, name: str) -> Any:
        v = getattr(self, name)
        if isinstance(v, Path):
            return str(v)
        return v


def default_of(name: str) -> Any:
    """BuildOptions field `name`'s default; MISSING where it has none or a factory makes it."""
    return _fields()[name].default


def flag_of(name: str) -> Flag:
    """How BuildOptions field `name` is given on the command line."""
    return _fields()[name].metadata["flag"]


def flagged() -> tuple[str, ...]:
    """The BuildOptions fields the command line sets, in declaration order."""
    return tuple(name for name, f in _fields().items() if "flag" in f.metadata)


@functools.cache
def _fields() -> dict:
    return {f.name: f for f in fields(BuildOptions)}


@functools.cache
def field_type(name: str) -> Any:
    """BuildOptions field `name`'s type, evaluated (this module's annotations are strings)."""
    return typing.get_type_hints(BuildOptions)[name]


def choices(name: str) -> tuple[str, ...]:
    """The values a choice field's `Literal` admits (besides None where it is optional)."""
    t = field_type(name)
    if typing.get_origin(t) is not Literal:
        t = next(a for a in typing.get_args(t) if typing.get_origin(a) is Literal)
    return typing.get_args(t)


def check_choice(name: str, value: Any, shown: str | None = None) -> Any:
    """`value` where choice field `name` admits it (None too, where the field is optional), else its
    `Refusal`; `shown` is how the refusal names the option (default: its flag)."""
    allowed = choices(name)
    if value in allowed or (value is None and type(None) in typing.get_args(field_type(name))):
        return value
    refusal = flag_of(name).refusal
    words = {"all": ", ".join(allowed),
             "either": f"{', '.join(allowed[:-1])} or {allowed[-1]}" if len(allowed) > 1 else allowed[0]}
    raise UsageError(refusal.code, f"{shown or flag_of(name).flags(name)[0]} {value}: {refusal.says.format(**words)}",
                     refusal.hint.format(**words))
