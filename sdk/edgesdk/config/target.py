"""Target files: a product's host CPU, its accelerators and their links, as validated data.

Every cost parameter is a `Figure` that names its source : a published
figure, a datasheet, or `edgesdk calibrate` on a named host. A target file with an
unknown key, a wrong type or a missing field is refused with the file, the line and
the field (exit 2).

A target file is untrusted input, and everything it holds is bounded before it reaches a
stage: its size, its nesting, what its YAML aliases expand to, every count, string and
number (finite, within the range of real hardware), and `codegen`, a TVM target whose keys,
`mcpu` (a CPU LLVM knows, `cpus.py`) and CUDA `arch` are checked here, not left to TVM.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, ValidationInfo,
                      field_validator, model_validator, with_config)
from pydantic_core import PydanticCustomError
from typing_extensions import Required, TypedDict

from ..errors import UsageError
from .cpus import COMMON_CPUS, LLVM_CPUS, NATIVE, close_cpus, cpu_arch

# Bounds on a target file. A real one is a few KB with about 200 values nested 6 deep; each bound
# is far above that and far below what makes loading or hashing a target slow.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32  # nested mappings and sequences
MAX_VALUES = 10_000  # YAML nodes, with every alias counted as the nodes it stands for
# (and aliases may not expand the text past MAX_FILE_BYTES characters either)
MAX_NOTES = 20  # problems listed one per line; the message gives the total

_Name = Annotated[str, StringConstraints(min_length=1, max_length=200)]
_Text = Annotated[str, StringConstraints(max_length=4096)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Figure(_Strict):
    """A cost parameter with its unit and where the number comes from."""

    # every unit in use (GB/s, MB/s, GFLOP/s, TOP/s, us, MB) puts real hardware far below 1e9
    value: float = Field(gt=0, le=1e9)
    unit: str = Field(min_length=1, max_length=32)
    source: _Text = Field(min_length=3)


class Link(_Strict):
    """The link between an accelerator and the host; every tensor that crosses it pays it."""

    name: _Name
    bandwidth: Figure  # MB/s
    latency: Figure  # us per transfer


# --- codegen: a TVM target dict ----------------------------------------------------------------
# The stages pass `codegen` to TVM as a plain dict, so it is validated as a TypedDict (the result is
# a dict) with the keys of TVM's llvm and cuda target kinds that a build may set; TVM would take
# others (cl-opt, libs, ...) that change the build in ways the records do not show.

# x86_64 | aarch64 and their other spellings, then vendor, os, environment
_TRIPLE = r"^(x86_64|amd64|aarch64|arm64)(-[A-Za-z0-9_.]{1,32}){1,3}$"
_TRIPLE_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}

LlvmTarget = with_config(ConfigDict(extra="forbid"))(TypedDict("LlvmTarget", {
    "kind": Required[Literal["llvm"]],
    "mtriple": Annotated[str, StringConstraints(pattern=_TRIPLE)],  # absent: the build host's
    "mcpu": Annotated[str, StringConstraints(max_length=64)],  # a name in cpus.py, or native
    "mattr": Annotated[list[Annotated[str, StringConstraints(pattern=r"^[+-][A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]],
                       Field(max_length=64)],  # ["+neon", "-avx512f"]
    "mabi": Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]{1,32}$")],
    "mfloat-abi": Literal["soft", "softfp", "hard"],
    "num-cores": Annotated[int, Field(ge=1, le=1024)],
    "opt-level": Annotated[int, Field(ge=0, le=3)],
    "vector-width": Annotated[int, Field(ge=1, le=4096)],
    "fast-math": bool,
}, total=False))

CudaTarget = with_config(ConfigDict(extra="forbid"))(TypedDict("CudaTarget", {
    "kind": Required[Literal["cuda"]],
    "arch": Required[Annotated[str, StringConstraints(pattern=r"^sm_[1-9][0-9]{1,2}[a-z]?$")]],  # sm_86, sm_90a
    "host": LlvmTarget,
    "max_shared_memory_per_block": Annotated[int, Field(ge=1, le=1 << 24)],  # bytes
    "max_threads_per_block": Annotated[int, Field(ge=1, le=4096)],
    "max_num_threads": Annotated[int, Field(ge=1, le=4096)],
    "thread_warp_size": Annotated[int, Field(ge=1, le=128)],
    "registers_per_block": Annotated[int, Field(ge=1, le=1 << 20)],
    "l2_cache_size_bytes": Annotated[int, Field(ge=1, le=1 << 34)],
}, total=False))


def _triple_arch(codegen: dict) -> str | None:
    """The architecture `mtriple` names; None without one (the build host's)."""
    return _TRIPLE_ARCH[codegen["mtriple"].split("-")[0]] if "mtriple" in codegen else None


def _check_cpu(codegen: dict, arch: str | None, at: tuple[str, ...]) -> None:
    """Refuse an `mcpu` that LLVM does not know for `arch` (for any architecture when None).

    The error carries `at`, the key path under `codegen`, so the report names the line of `mcpu`
    itself, and `suggest`, the names to offer in the hint.
    """
    cpu = codegen.get("mcpu")
    tables = [LLVM_CPUS[arch]] if arch else LLVM_CPUS.values()
    if cpu is None or cpu == NATIVE or any(cpu in names for names in tables):
        return
    other = cpu_arch(cpu)
    close = close_cpus(cpu, arch)
    if other is not None:  # a known cpu of the other architecture
        message, suggest = "'{cpu}' is an {other} cpu, not {arch}", f"{arch} cpus: {', '.join(COMMON_CPUS[arch])}"
    elif close:
        message, suggest = "llvm knows no {arch} cpu '{cpu}'", f"the closest llvm knows: {', '.join(close)}"
    else:
        message = "llvm knows no {arch} cpu '{cpu}'"
        suggest = "; ".join(f"{a} cpus: {', '.join(COMMON_CPUS[a])}" for a in ([arch] if arch else COMMON_CPUS))
    raise PydanticCustomError("unknown_cpu", message, {"cpu": cpu, "arch": arch or "x86_64 or aarch64",
                                                       "other": other, "at": at, "suggest": suggest})


def _with_float32(rates: dict, field: str) -> dict:
    """A device's compute rates: float32 is the one every float node is costed at (`devices/`); the
    others (grouped convolutions, int8, float16) refine it where the target gives them."""
    if "float32" not in rates:
        raise ValueError(f"{field} has no float32 rate, the one every float node is costed at")
    return rates


# a CPU backend's name as `edgesdk.backends` registers it (tvm, onnxruntime, litert, ...)
_BackendName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]


class CpuBackendFigures(_Strict):
    """One CPU backend's own cost figures: a CPU segment compiled by that backend is costed with them
    (`devices/cpu.py`). `edgesdk calibrate` fits them from segments timed on the backend as a bundle
    runs them; a figure an entry leaves out (a key of `peak_gflops` included) is the CPU device's own."""

    peak_gflops: dict[Literal["float32", "float32_grouped", "int8"], Figure] = Field(default_factory=dict)
    memory_bandwidth: Figure | None = None  # GB/s
    kernel_overhead: Figure | None = None  # us per kernel
    layer_overhead: Figure | None = None  # us per convolution or matrix product
    # Memory in two tiers (optional, both or neither): a node whose parameter and activation bytes fit
    # in cache_capacity (MiB) moves them at cache_bandwidth (GB/s), not at memory_bandwidth: a backend
    # whose kernels hand small tensors on in cache (XNNPACK's) runs them far faster than DRAM allows
    cache_bandwidth: Figure | None = None
    cache_capacity: Figure | None = None

    @model_validator(mode="after")
    def _cache_tier_whole(self):
        if (self.cache_bandwidth is None) != (self.cache_capacity is None):
            raise ValueError("cache_bandwidth and cache_capacity go together: give both or neither")
        return self


class CpuDevice(_Strict):
    kind: Literal["cpu"]
    name: _Name
    arch: Literal["x86_64", "aarch64"]
    # threads the runtime and the schedule use; the bound is real hardware's (a 2-socket server has
    # fewer than 1024 hardware threads), not the schedule's: its thread splits grow as cores^(groups-1)
    cores: int = Field(ge=1, le=1024)
    # A TVM target as a JSON dict, e.g. {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}.
    codegen: LlvmTarget
    cross_compiler: str | None = Field(default=None, min_length=1, max_length=1024)
    # float32_grouped (optional): the rate of grouped/depthwise convolutions, which reach a fraction of
    # the dense rate on CPUs (too little work per weight to fill the vector units)
    peak_gflops: dict[Literal["float32", "float32_grouped", "int8"], Figure]
    memory_bandwidth: Figure  # GB/s
    kernel_overhead: Figure  # us per kernel launch
    # layer_overhead (optional): us that a convolution or matrix product pays on top of kernel_overhead
    # (devices/cost.py, is_mac_layer); without it every node pays kernel_overhead alone
    layer_overhead: Figure | None = None
    # backends (optional): figures of one CPU backend (tvm, onnxruntime, litert), fitted by `edgesdk
    # calibrate`, for the CPU segments it runs; without an entry a backend is costed with the figures above
    backends: dict[_BackendName, CpuBackendFigures] = Field(default_factory=dict, max_length=16)
    # Inter-operator parallelism (optional; without step_dispatch the CPU runs one operator at a time):
    # step_dispatch: us to hand a stage's groups to worker threads and collect them (the runtime's
    # thread hand-off and its extra segment calls); parallel_efficiency: e in (0, 1], a kernel on p
    # threads runs at (1 + e (p - 1)) times its one-thread speed (1: perfect scaling).
    step_dispatch: Figure | None = None
    parallel_efficiency: Figure | None = None
    # The CPU segments' precision policy (`--cpu-precision` overrides): bf16 (where the CPU has AVX512_BF16 or
    # AMX), fp16 (AVX512-FP16) and int8 add candidates in that precision, auto all three, which the tune stage
    # measures and admits only behind its accuracy gate; fp32 keeps every CPU segment float32.
    precision: Literal["fp32", "bf16", "fp16", "int8", "auto"] = "fp32"

    @field_validator("codegen")
    @classmethod
    def _codegen_is_for_arch(cls, codegen: dict, info: ValidationInfo) -> dict:
        arch = info.data.get("arch")
        if arch is None:  # arch itself is wrong; that is the error to report
            return codegen
        if _triple_arch(codegen) not in (None, arch):
            raise ValueError(f"mtriple {codegen['mtriple']} is for {_triple_arch(codegen)}, but arch is {arch}")
        _check_cpu(codegen, arch, ("mcpu",))
        return codegen

    @field_validator("peak_gflops")
    @classmethod
    def _float32_rate_given(cls, peaks: dict) -> dict:
        return _with_float32(peaks, "peak_gflops")

    @property
    def count(self) -> int:
        return 1

    def logical_ids(self) -> list[str]:
        return ["cpu"]


class EdgeTpuDevice(_Strict):
    kind: Literal["edgetpu"]
    name: _Name
    count: int = Field(ge=1, le=16)
    physical: list[_Name] = Field(max_length=16)  # what the runtime opens: usb:0, pci:0
    peak_tops_int8: Figure
    on_chip_memory: Figure  # MB of parameter cache; weights beyond it stream every inference
    kernel_overhead: Figure  # us per op
    link: Link

    @model_validator(mode="after")
    def _one_physical_per_device(self) -> "EdgeTpuDevice":
        if len(self.physical) != self.count:
            raise ValueError(f"physical lists {len(self.physical)} devices but count is {self.count}")
        return self

    def logical_ids(self) -> list[str]:
        return [f"edgetpu:{i}" for i in range(self.count)]


class GpuDevice(_Strict):
    kind: Literal["gpu"]
    name: _Name
    count: int = Field(ge=1, le=16)
    physical: list[_Name] = Field(max_length=16)
    codegen: CudaTarget
    sm_count: int = Field(ge=1, le=1024)
    memory_gb: float = Field(gt=0, le=4096)
    peak_tflops: dict[Literal["float32", "float16"], Figure]
    memory_bandwidth: Figure  # GB/s
    kernel_overhead: Figure  # us per kernel launch
    link: Link

    @field_validator("codegen")
    @classmethod
    def _host_cpu_is_known(cls, codegen: dict) -> dict:
        if "host" in codegen:
            _check_cpu(codegen["host"], _triple_arch(codegen["host"]), ("host", "mcpu"))
        return codegen

    @field_validator("peak_tflops")
    @classmethod
    def _float32_rate_given(cls, peaks: dict) -> dict:
        return _with_float32(peaks, "peak_tflops")

    @model_validator(mode="after")
    def _one_physical_per_device(self) -> "GpuDevice":
        if len(self.physical) != self.count:
            raise ValueError(f"physical lists {len(self.physical)} devices but count is {self.count}")
        return self

    def logical_ids(self) -> list[str]:
        return [f"gpu:{i}" for i in range(self.count)]


# the target entry of each device kind, in the order the JSON Schema lists them (devices/<kind>.py is
# each kind's model; the schemas stay here, so that `edgesdk targets schema` needs only config)
DEVICE_SCHEMAS = (CpuDevice, EdgeTpuDevice, GpuDevice)
DEVICE_KINDS = tuple(get_args(s.model_fields["kind"].annotation)[0] for s in DEVICE_SCHEMAS)
Device = Annotated[Union[DEVICE_SCHEMAS], Field(discriminator="kind")]

# the kind of the host: the one device every target has, which runs what no accelerator takes
HOST = "cpu"


class LegalizePolicy(_Strict):
    max_abs_error: float = Field(default=0.01, gt=0)


_Cosine = Annotated[float, Field(ge=-1, le=1)]
_Share = Annotated[float, Field(ge=0, le=1e6)]  # an error as a share of the fp32 part's range


class ScoresGate(_Strict):
    """What a part after a sigmoid or softmax keeps of fp32 (compression/accuracy.py); null: not judged.
    The defaults and the measurements they come from: docs/accuracy.md."""

    cosine: _Cosine | None = 0.9
    mean_error: _Share | None = 0.1
    top1: Annotated[float, Field(ge=0, le=1)] | None = 0.9
    max_error: _Share | None = None


class ValuesGate(_Strict):
    """What any other part (boxes, landmarks, logits, embeddings) keeps of fp32; null: not judged."""

    cosine: _Cosine | None = 0.98
    mean_error: _Share | None = 0.02
    max_error: _Share | None = None


class AccuracyPolicy(_Strict):
    """The accuracy gate of a build with reduced precision (int8 on the Edge TPU or the CPU): each model
    output, in the parts it is judged by, against fp32 on held-out samples."""

    scores: ScoresGate = ScoresGate()
    values: ValuesGate = ValuesGate()


class Target(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: _Text
    devices: list[Device] = Field(min_length=1, max_length=16)
    legalize: LegalizePolicy = LegalizePolicy()
    accuracy: AccuracyPolicy = AccuracyPolicy()

    @model_validator(mode="after")
    def _exactly_one_host(self) -> "Target":
        cpus = self.devices_of(HOST)
        if len(cpus) != 1:
            raise ValueError(f"a target has exactly one cpu device (the host), found {len(cpus)}")
        return self

    @property
    def host(self) -> CpuDevice:
        return self.device(HOST)

    @property
    def accelerators(self) -> list[EdgeTpuDevice | GpuDevice]:
        return [d for d in self.devices if d.kind != HOST]

    def device_map(self) -> dict[str, str]:
        """Logical device id -> the physical device string the runtime opens."""
        out = {"cpu": "cpu"}
        for acc in self.accelerators:
            out.update(zip(acc.logical_ids(), acc.physical))
        return out

    def device(self, kind: str):
        """The entry of `kind`."""
        for d in self.devices:
            if d.kind == kind:
                return d
        raise UsageError("target.no-device", f"target '{self.name}' has no {kind} device",
                         f"its devices: {', '.join(d.kind for d in self.devices)}; add a {kind} entry under "
                         "devices, or pick a target that has one (edgesdk targets list)")

    def devices_of(self, kind: str) -> list:
        """The entries of `kind`, in the file's order (none when the target has no such device)."""
        return [d for d in self.devices if d.kind == kind]

    def logical_ids(self, kind: str) -> list[str]:
        return [i for d in self.devices_of(kind) for i in d.logical_ids()]

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def register_device_schema(schema: type) -> None:
    """Add a device kind's target entry (a model with `kind: Literal["..."]`, `count`, `physical` and
    `logical_ids()` for an accelerator) to what target files may list; `devices/` registers the kind's
    model beside it. The shipped kinds come first, so their JSON Schema and error lines do not move."""
    kind = get_args(schema.model_fields["kind"].annotation)[0]
    if kind in DEVICE_KINDS:
        raise ValueError(f"a device kind {kind!r} is already registered")
    _set_device_schemas((*DEVICE_SCHEMAS, schema))


def unregister_device_schema(kind: str) -> None:
    _set_device_schemas(tuple(s for s in DEVICE_SCHEMAS if get_args(s.model_fields["kind"].annotation)[0] != kind))


def _set_device_schemas(schemas: tuple[type, ...]) -> None:
    global DEVICE_SCHEMAS, DEVICE_KINDS, Device
    DEVICE_SCHEMAS = schemas
    DEVICE_KINDS = tuple(get_args(s.model_fields["kind"].annotation)[0] for s in schemas)
    Device = Annotated[Union[schemas], Field(discriminator="kind")]
    # the field keeps its constraints (1 to 16 entries); only the union of entries changes
    Target.model_fields["devices"].annotation = list[Device]
    Target.model_rebuild(force=True)


# --- loading --------------------------------------------------------------------------------


def builtin_target_dir() -> Path:
    """The shipped targets: `targets/` of a source checkout, else the wheel's data files."""
    for cand in (
        Path(os.environ.get("EDGESDK_TARGETS", "")) if os.environ.get("EDGESDK_TARGETS") else None,
        Path(__file__).resolve().parents[3] / "targets",
        Path(sys.prefix) / "share" / "edgesdk" / "targets",
    ):
        if cand is not None and cand.is_dir():
            return cand
    return Path(sys.prefix) / "share" / "edgesdk" / "targets"


def builtin_targets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(builtin_target_dir().glob("*.yaml"))}


def resolve_target_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = builtin_targets()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    if p.suffix in (".yaml", ".yml") or os.sep in str(name_or_path):
        raise UsageError(
            "target.not-found",
            f"target file {name_or_path} does not exist",
            f"shipped targets: {', '.join(shipped) or 'none'} (edgesdk targets list)",
        )
    raise UsageError(
        "target.unknown",
        f"unknown target '{name_or_path}'",
        f"give a target file or one of: {', '.join(shipped)} (edgesdk targets list)",
    )


def load_target(name_or_path: str | Path) -> tuple[Target, Path]:
    """Parse and validate a target file; errors name the file, the line and the field."""
    path = resolve_target_path(name_or_path)
    text = _read_text(path)
    try:
        # the bounds first, over parser events: composing recurses once per level, so a 5,000-deep
        # document overflows the stack, and an alias bomb blows up whatever walks the loaded data
        _check_shape(path, yaml.parse(text, Loader=yaml.SafeLoader))
        loader = _TargetLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise _yaml_error(path, text, e) from None
    if loader.duplicates:
        where = [f"{path}:{mark.line + 1}: duplicate key '{key}' (first given at line {first.line + 1})"
                 for key, first, mark in sorted(loader.duplicates, key=lambda d: d[2].index)]
        raise UsageError("target.duplicate-key", where[0],
                         "a key appears once in a mapping; YAML would keep only the last value, so remove one",
                         notes=where[1:])
    if not isinstance(data, dict):
        raise UsageError("target.yaml", f"{path}:1: a target file is a mapping of keys",
                         "see `edgesdk targets schema` for the expected keys")
    try:
        return Target.model_validate(data), path
    except ValidationError as e:
        errors = e.errors()
        problems = [_describe(path, node, err) for err in errors[:MAX_NOTES]]
        if len(errors) > MAX_NOTES:
            problems.append(f"{path}: and {len(errors) - MAX_NOTES} more")
        hints = list(dict.fromkeys(f"for mcpu '{err['ctx']['cpu']}', {err['ctx']['suggest']}" for err in errors
                                   if err["type"] == "unknown_cpu"))
        if hints:
            hints.append("`mcpu: native` builds for the build host's cpu")
        raise UsageError(
            "target.invalid",
            f"{path}: {len(errors)} problem{'s' if len(errors) > 1 else ''} in the target file",
            "; ".join(hints + ["fix the fields above; `edgesdk targets schema` writes the JSON Schema for editor "
                               "completion"]),
            notes=problems,
        ) from None


def _read_text(path: Path) -> str:
    """The file as UTF-8 text, read no further than MAX_FILE_BYTES."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise UsageError("target.unreadable", f"{path}: cannot read the target file: {str(e.strerror or e).lower()}",
                         "check the path and its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError("target.too-large", f"{path}: the target file is over the {MAX_FILE_BYTES} byte limit",
                         "a target file holds a few KB: the devices, their figures and the policy")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UsageError("target.encoding", f"{path}:{line}: not utf-8 text (byte 0x{data[e.start]:02x})",
                         "save the target file as UTF-8") from None


class _TargetLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but it records each key given twice in one mapping (YAML would keep the
    last one without a word), and a tagged value its constructor cannot read (an integer too long for
    Python to convert, `!!bool maybe`, `!!float abc`, `!!timestamp 2020-13-45`) is a YAML error at its
    line, not the constructor's ValueError, KeyError or AttributeError."""

    def __init__(self, text: str):
        super().__init__(text)
        self.duplicates: list[tuple[str, yaml.Mark, yaml.Mark]] = []  # key, its first mark, this mark

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`; keys after it override, as meant
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if seen is not key_node:
                    self.duplicates.append((str(key)[:80], seen.start_mark, key_node.start_mark))
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, KeyError, AttributeError, TypeError):
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise yaml.constructor.ConstructorError(None, None, f"{_shown_value(node)} is not a valid {tag}",
                                                    node.start_mark) from None

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            if len(node.value) <= sys.get_int_max_str_digits():
                raise  # not an integer at all (`!!int 0x`): construct_object says so
            raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(node.value)} digits",
                                                    node.start_mark) from None


_TargetLoader.add_constructor("tag:yaml.org,2002:int", _TargetLoader.construct_yaml_int)


def _shown_value(node: yaml.Node) -> str:
    return repr(node.value[:40]) if isinstance(node.value, str) else "(a collection)"


def _check_shape(path: Path, events: Iterable[yaml.Event]) -> None:
    """Refuse a document nested deeper than MAX_DEPTH or holding more than MAX_VALUES nodes, with
    each alias counted as what it expands to: the nodes, the characters and the depth of the node
    its anchor names, recorded when that node closes. An alias bomb (ten aliases of the level below
    on each of ten levels: 10^10 nodes in 1 KB) is refused after MAX_VALUES nodes' worth of events,
    before anything is expanded. PyYAML's parser is a state machine, so no depth recurses here.
    """
    expanded: dict[str, tuple[int, int, int]] = {}  # anchor -> (nodes, characters, levels) it expands to
    # the collections being parsed, outermost first: [anchor, nodes and characters before it, deepest level in it]
    enclosing: list[list[Any]] = []
    nodes = chars = 0
    for event in events:
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            if any(frame[0] == event.anchor for frame in enclosing):
                raise UsageError("target.yaml", f"{path}:{line}: alias *{event.anchor} is inside the node it names",
                                 "an alias repeats a node given before it; it cannot repeat an enclosing one")
            n, c, d = expanded.get(event.anchor, (0, 0, 0))  # undefined: the composer reports it
            nodes, chars, depth = nodes + n, chars + c, len(enclosing) + d
        elif isinstance(event, yaml.ScalarEvent):
            nodes, chars, depth = nodes + 1, chars + len(event.value), len(enclosing)
            if event.anchor is not None:
                expanded[event.anchor] = (1, len(event.value), 0)
        elif isinstance(event, yaml.CollectionStartEvent):
            enclosing.append([event.anchor, nodes, chars, 0])
            nodes, depth = nodes + 1, len(enclosing)
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, nodes0, chars0, inside = enclosing.pop()
            if anchor is not None:
                expanded[anchor] = (nodes - nodes0, chars - chars0, inside - len(enclosing))
            depth = inside
        else:
            continue
        if enclosing:
            enclosing[-1][3] = max(enclosing[-1][3], depth)
        if depth > MAX_DEPTH:
            raise UsageError("target.too-deep", f"{path}:{line}: nested more than {MAX_DEPTH} levels deep",
                             "a target nests 6 levels: devices, a device, a figure; see `edgesdk targets schema`")
        if nodes > MAX_VALUES or chars > MAX_FILE_BYTES:
            what = f"{MAX_VALUES} values" if nodes > MAX_VALUES else f"{MAX_FILE_BYTES} characters"
            raise UsageError("target.too-large",
                             f"{path}:{line}: the target holds more than {what}"
                             + (" once its aliases are expanded" if expanded else ""),
                             "a target holds a few hundred values; an alias counts as the node it repeats")


def _yaml_error(path: Path, text: str, e: yaml.YAMLError) -> UsageError:
    if isinstance(e, yaml.reader.ReaderError):  # a control character; its position counts characters
        return UsageError("target.yaml",
                          f"{path}:{text.count(chr(10), 0, e.position) + 1}: not valid YAML: "
                          f"character #x{e.character:04x} is not allowed",
                          "a target file is printable text; remove the control character")
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}" if mark else str(path)
    return UsageError("target.yaml", f"{where}: not valid YAML: {getattr(e, 'problem', e)}",
                      "check the indentation and quoting near that line")


def _describe(path: Path, root: yaml.Node | None, err: dict[str, Any]) -> str:
    # pydantic puts the discriminator tag into the location of union members; drop it. A codegen
    # check names the key under codegen it is about (`at`), for that key's line.
    loc = _strip_tags(err["loc"]) + list(err.get("ctx", {}).get("at", ()))
    line = _line_of(root, loc, missing=err["type"] == "missing")
    field = ".".join(str(x) for x in loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = f"unknown key '{field}'"
    elif kind == "missing":
        msg = f"missing field '{field}'"
    elif kind == "string_pattern_mismatch":  # the pattern as written: lowercasing it would change it
        msg = f"field '{field}': string should match pattern '{err['ctx']['pattern']}'"
    else:
        msg = f"field '{field}': {err['msg'].lower()}"
    return f"{path}:{line}: {msg}"


def _strip_tags(loc: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for i, x in enumerate(loc):
        # devices.0.edgetpu.count -> devices.0.count (the tag follows a list index)
        if isinstance(x, str) and x in DEVICE_KINDS and i > 0 and isinstance(loc[i - 1], int):
            continue
        out.append(x)
    return out


def _line_of(node: yaml.Node | None, loc: list[Any], *, missing: bool) -> int:
    """1-based line of the YAML node at `loc` (for a missing key: of its parent mapping)."""
    if node is None:
        return 1
    keys = loc[:-1] if missing else loc
    cur = node
    for depth, key in enumerate(keys):
        nxt = None
        if isinstance(cur, yaml.MappingNode):
            for k, v in cur.value:
                if k.value == str(key):
                    # the last key's own line, not its value's (which may start lines later)
                    nxt = k if depth == len(keys) - 1 else v
                    break
        elif isinstance(cur, yaml.SequenceNode) and isinstance(key, int) and key < len(cur.value):
            nxt = cur.value[key]
        if nxt is None:
            break
        cur = nxt
    return cur.start_mark.line + 1


def target_schema() -> dict[str, Any]:
    schema = Target.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "edgesdk target"
    return schema
