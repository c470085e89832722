"""Target files: a product's host CPU, its accelerators and their links, as validated data.

Every cost parameter is a `Figure` that names its source (DESIGN §3, §8): a published
figure, a datasheet, or `edgesdk calibrate` on a named host. A target file with an
unknown key, a wrong type or a missing field is refused with the file, the line and
the field (exit 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import UsageError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Figure(_Strict):
    """A cost parameter with its unit and where the number comes from."""

    value: float = Field(gt=0)
    unit: str
    source: str = Field(min_length=3)


class Link(_Strict):
    """The link between an accelerator and the host; every tensor that crosses it pays it."""

    name: str
    bandwidth: Figure  # MB/s
    latency: Figure  # us per transfer


class CpuDevice(_Strict):
    kind: Literal["cpu"]
    name: str
    arch: Literal["x86_64", "aarch64"]
    cores: int = Field(ge=1)
    # A TVM target as a JSON dict, e.g. {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}.
    codegen: dict[str, Any]
    cross_compiler: str | None = None
    # float32_grouped (optional): the rate of grouped/depthwise convolutions, which reach a fraction of
    # the dense rate on CPUs (too little work per weight to fill the vector units)
    peak_gflops: dict[Literal["float32", "float32_grouped", "int8"], Figure]
    memory_bandwidth: Figure  # GB/s
    kernel_overhead: Figure  # us per kernel launch
    # layer_overhead (optional): us that a convolution or matrix product pays on top of kernel_overhead
    # (devices/cost.py, is_mac_layer); without it every node pays kernel_overhead alone
    layer_overhead: Figure | None = None
    # Inter-operator parallelism (optional; without step_dispatch the CPU runs one operator at a time):
    # step_dispatch: us to hand a stage's groups to worker threads and collect them (the runtime's
    # thread hand-off and its extra segment calls); parallel_efficiency: e in (0, 1], a kernel on p
    # threads runs at (1 + e (p - 1)) times its one-thread speed (1: perfect scaling).
    step_dispatch: Figure | None = None
    parallel_efficiency: Figure | None = None

    @property
    def count(self) -> int:
        return 1

    def logical_ids(self) -> list[str]:
        return ["cpu"]


class EdgeTpuDevice(_Strict):
    kind: Literal["edgetpu"]
    name: str
    count: int = Field(ge=1, le=16)
    physical: list[str]  # what the runtime opens: usb:0, pci:0
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
    name: str
    count: int = Field(ge=1, le=16)
    physical: list[str]
    codegen: dict[str, Any]
    sm_count: int = Field(ge=1)
    memory_gb: float = Field(gt=0)
    peak_tflops: dict[Literal["float32", "float16"], Figure]
    memory_bandwidth: Figure  # GB/s
    kernel_overhead: Figure  # us per kernel launch
    link: Link

    @model_validator(mode="after")
    def _one_physical_per_device(self) -> "GpuDevice":
        if len(self.physical) != self.count:
            raise ValueError(f"physical lists {len(self.physical)} devices but count is {self.count}")
        return self

    def logical_ids(self) -> list[str]:
        return [f"gpu:{i}" for i in range(self.count)]


Device = Annotated[Union[CpuDevice, EdgeTpuDevice, GpuDevice], Field(discriminator="kind")]


class LegalizePolicy(_Strict):
    max_abs_error: float = Field(default=0.01, gt=0)


class Target(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str
    devices: list[Device] = Field(min_length=1)
    legalize: LegalizePolicy = LegalizePolicy()

    @model_validator(mode="after")
    def _exactly_one_host(self) -> "Target":
        cpus = [d for d in self.devices if d.kind == "cpu"]
        if len(cpus) != 1:
            raise ValueError(f"a target has exactly one cpu device (the host), found {len(cpus)}")
        return self

    @property
    def host(self) -> CpuDevice:
        return next(d for d in self.devices if isinstance(d, CpuDevice))

    @property
    def accelerators(self) -> list[EdgeTpuDevice | GpuDevice]:
        return [d for d in self.devices if not isinstance(d, CpuDevice)]

    def device_map(self) -> dict[str, str]:
        """Logical device id -> the physical device string the runtime opens."""
        out = {"cpu": "cpu"}
        for acc in self.accelerators:
            out.update(zip(acc.logical_ids(), acc.physical))
        return out

    def logical_ids(self, kind: str) -> list[str]:
        return [i for d in self.devices if d.kind == kind for i in d.logical_ids()]

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


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
    text = path.read_text()
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UsageError("target.yaml", f"{where}: not valid YAML: {getattr(e, 'problem', e)}",
                         "check the indentation and quoting near that line") from None
    if not isinstance(data, dict):
        raise UsageError("target.yaml", f"{path}:1: a target file is a mapping of keys",
                         "see `edgesdk targets schema` for the expected keys")
    try:
        return Target.model_validate(data), path
    except ValidationError as e:
        problems = [_describe(path, node, err) for err in e.errors()]
        raise UsageError(
            "target.invalid",
            f"{path}: {len(problems)} problem{'s' if len(problems) > 1 else ''} in the target file",
            "fix the fields above; `edgesdk targets schema` writes the JSON Schema for editor completion",
            notes=problems,
        ) from None


def _describe(path: Path, root: yaml.Node | None, err: dict[str, Any]) -> str:
    # pydantic puts the discriminator tag into the location of union members; drop it
    loc = _strip_tags(err["loc"])
    line = _line_of(root, loc, missing=err["type"] == "missing")
    field = ".".join(str(x) for x in loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = f"unknown key '{field}'"
    elif kind == "missing":
        msg = f"missing field '{field}'"
    else:
        msg = f"field '{field}': {err['msg'].lower()}"
    return f"{path}:{line}: {msg}"


def _strip_tags(loc: tuple[Any, ...]) -> list[Any]:
    out: list[Any] = []
    for i, x in enumerate(loc):
        # devices.0.edgetpu.count -> devices.0.count (the tag follows a list index)
        if isinstance(x, str) and x in ("cpu", "edgetpu", "gpu") and i > 0 and isinstance(loc[i - 1], int):
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
