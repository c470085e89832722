"""Coral's `edgetpu_compiler`: run it when it is installed, and read what it says.

The compiler cannot be installed on our build machines (no registry carries it), so without it
the bundle ships the uncompiled int8 segments and `finish_command` says exactly how to compile
them later. Tests put a stand-in script named `edgetpu_compiler` on PATH (a test double).

What `-s` prints (Coral's docs and the compiler's own output): the totals (ops on the Edge TPU and
on the CPU, on-chip and off-chip parameter memory), the line "Model successfully compiled but not
all operations are supported by the Edge TPU" when some are not, and a table

    Operator                       Count      Status
    CONV_2D                        42         Mapped to Edge TPU
    MEAN                           1          Operation is otherwise supported, but not mapped due to ...
    MEAN                           9          More than one subgraph is not supported

with one row per (operator, status). Version 16 may print only the rows that are not mapped and then
"... All other operators were mapped successfully".

Co-compilation (`edgetpu_compiler -s -o DIR a.tflite b.tflite ...`, Coral's "Co-compiling multiple
models"): the models that will run on one Edge TPU share its parameter cache, the first given taking
its share first; the compiler prints the block above (from "Input model:") once per model, and a model
compiled alone cannot use cache space its partners fill at run time. The package stage compiles each
Edge TPU's segments in one call, in the plan's cache priority (`finish_group`); a TPU's usable
capacity is what the first model used plus what it left (the log's "remaining").

How the compiler cuts a model (Coral's model requirements, coral.ai/docs/edgetpu/models-intro, and
Coral's engineer in google-coral/edgetpu issue #461): without `-a` (which we do not pass) it maps ops
in execution order up to the first op it cannot map; that op and every op after it run on the CPU,
even the ones it could map, and show "More than one subgraph is not supported". `mapping` finds that
first op in the uncompiled model.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .registry import Finished, FinishJob

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
MAPPED = "Mapped to Edge TPU"
# the status of ops after the cut: a consequence of the first unmapped op, not its reason
AFTER_THE_CUT = "More than one subgraph is not supported"
PARTLY_MAPPED = "Model successfully compiled but not all operations are supported by the Edge TPU"

_HEADER = re.compile(r"^\s*Operator\s+Count\s+Status\s*$", re.IGNORECASE)
_ROW = re.compile(r"^\s*([A-Za-z][\w.-]*)\s+(\d+)\s+(\S.*?)\s*$")
_OTHERS_MAPPED = re.compile(r"all other operators were mapped", re.IGNORECASE)


@dataclass(frozen=True)
class OpRow:
    """One row of the compiler's per-operator table."""

    operator: str
    count: int
    status: str

    @property
    def mapped(self) -> bool:
        return " ".join(self.status.split()).lower() == MAPPED.lower()


@dataclass(frozen=True)
class CompileLog:
    version: str
    ops_on_tpu: int
    ops_on_cpu: int
    on_chip_bytes: int
    off_chip_bytes: int
    text: str
    on_chip_remaining_bytes: int = 0    # cache left after this model (and those compiled before it)
    ops: tuple[OpRow, ...] = ()         # the per-operator table, in the compiler's order; () without one
    partly_mapped: bool = False         # the compiler said not all operations are supported
    others_mapped: bool = False         # the table lists only unmapped rows: every other op is mapped


@dataclass(frozen=True)
class Mapping:
    """Where the compiler cut one segment's TFLite model: ops[:on_tpu] run on the Edge TPU, the rest on
    the host CPU."""

    ops: tuple[str, ...]                # the uncompiled model's operators, in execution order
    on_tpu: int
    status: str = ""                    # why ops[on_tpu] is not mapped ("" when every op is)

    @property
    def on_cpu(self) -> int:
        return len(self.ops) - self.on_tpu

    @property
    def first_unmapped(self) -> str | None:
        return self.ops[self.on_tpu] if self.on_cpu else None


def find() -> str | None:
    return shutil.which("edgetpu_compiler")


def finish_command(tflite_files: list[str]) -> str:
    return "edgetpu_compiler -s -o segments " + " ".join(tflite_files)


def finish_group_command(groups: list[list[str]]) -> str:
    """One co-compiling call per Edge TPU (each group in its cache priority)."""
    return " && ".join(finish_command(g) for g in groups if g)


def unfinished_warning(tflite_files: list[str], command: str | None = None) -> str:
    """The build's warning when the compiler is not installed, with the command that finishes the bundle
    (`command`, default one call for all the files)."""
    return (f"edgetpu_compiler is not installed: {len(tflite_files)} Edge TPU model(s) ship uncompiled and run "
            f"their int8 model on the CPU until compiled; to finish: cd bundle && "
            f"{command or finish_command(tflite_files)}")


def finish(job: FinishJob) -> Finished:
    """One segment compiled alone: `finish_group([job])`."""
    return finish_group([job])[0]


def finish_group(jobs: Sequence[FinishJob]) -> list[Finished]:
    """The Edge TPU's finisher (`registry.Finisher`): the int8 models of the segments that run on one
    Edge TPU (`job.artifact`, relative to `job.bundle`), co-compiled in one call in the order given (the
    cache priority), and what ships for each. A model the compiler maps all of ships compiled; one it
    maps part of ships compiled, with the mapping (`Finished.partial`) for re-costing; one it maps
    nothing of ships uncompiled, the compiled one removed: it would only add the delegate's overhead to
    a model that runs on the CPU anyway."""
    from .tflite import operators

    if not jobs:
        return []
    bundle = jobs[0].bundle
    tflites = [bundle / j.artifact for j in jobs]
    out = []
    for job, tflite, (compiled, log) in zip(jobs, tflites, compile_models(tflites, bundle / "segments")):
        record = {k: v for k, v in dataclasses.asdict(log).items() if k != "text"}
        mapped = mapping(operators(tflite.read_bytes())[0], log)
        if not mapped.on_cpu:
            out.append(Finished(f"segments/{compiled.name}", record))
        elif not mapped.on_tpu:
            compiled.unlink()
            out.append(Finished(job.artifact, record, mapped))
        else:
            out.append(Finished(f"segments/{compiled.name}", record, mapped))
    return out


def compile_models(tflites: Sequence[Path], out_dir: Path) -> list[tuple[Path, CompileLog]]:
    """`tflites` co-compiled in one call (one Edge TPU's models, the first given the cache first): each
    compiled model and its block of the log."""
    exe = find()
    assert exe, "compile_models needs edgetpu_compiler on PATH"
    names = ", ".join(t.name for t in tflites)
    cmd = [exe, "-s", "-o", str(out_dir), *map(str, tflites)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600 * len(tflites))
    compiled = [out_dir / f"{t.stem}_edgetpu.tflite" for t in tflites]
    missing = [t.name for t, c in zip(tflites, compiled) if not c.exists()]
    if proc.returncode != 0 or missing:
        what = (f"edgetpu_compiler failed on {names} (exit {proc.returncode})" if proc.returncode else
                f"edgetpu_compiler wrote no compiled model for {', '.join(missing)}")
        raise UserError("package.edgetpu-compiler", what,
                        "see its output below; the uncompiled int8 models still run on the CPU",
                        notes=(proc.stdout + proc.stderr).strip().splitlines()[-10:])
    blocks = split_log(proc.stdout)
    if len(tflites) > 1 and len(blocks) != len(tflites):
        raise UserError("package.edgetpu-compiler", f"edgetpu_compiler printed {len(blocks)} model block(s) for "
                        f"{len(tflites)} co-compiled models ({names})",
                        "report it with the compiler's version; compiling them one by one would lose the shared cache",
                        notes=proc.stdout.strip().splitlines()[-10:])
    return [(c, parse_log(b)) for c, b in zip(compiled, blocks if len(tflites) > 1 else [proc.stdout])]


_INPUT_MODEL = re.compile(r"^\s*Input model:", re.IGNORECASE | re.MULTILINE)


def split_log(text: str) -> list[str]:
    """A co-compiling call's log cut into one text per model: each "Input model:" block, with the
    lines before the first (the compiler's version) in front of each. A log without such a line is one
    text."""
    starts = [m.start() for m in _INPUT_MODEL.finditer(text)]
    if not starts:
        return [text]
    head = text[:starts[0]]
    return [head + text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]


def parse_log(text: str) -> CompileLog:
    def count(pattern: str) -> int | None:
        m = re.search(pattern, text, re.IGNORECASE)
        return int(m.group(1)) if m else None

    def size(pattern: str) -> int:
        m = re.search(pattern + r"\s*([\d.]+)\s*(B|KiB|MiB|GiB)\b", text, re.IGNORECASE)
        if not m:
            return 0
        unit = next(u for u in _UNITS if u.lower() == m.group(2).lower())
        return int(float(m.group(1)) * _UNITS[unit])

    rows, in_table, others_mapped = [], False, False
    for line in text.splitlines():
        if _HEADER.match(line):
            in_table = True
        elif in_table and line.strip():
            row = _ROW.match(line)
            if row:
                rows.append(OpRow(row.group(1), int(row.group(2)), " ".join(row.group(3).split())))
            else:  # the table ends at its first line that is not a row
                in_table = False
                others_mapped |= bool(_OTHERS_MAPPED.search(line))
    on_tpu = count(r"Number of operations that will run on Edge TPU:\s*(\d+)")
    on_cpu = count(r"Number of operations that will run on CPU:\s*(\d+)")
    if on_tpu is None and on_cpu is None and rows and not others_mapped:
        # an older compiler prints the table without the totals: a complete table has them
        on_tpu = sum(r.count for r in rows if r.mapped)
        on_cpu = sum(r.count for r in rows if not r.mapped)
    version = re.search(r"Edge TPU Compiler version ([\w.]+)", text)
    return CompileLog(
        version=version.group(1) if version else "unknown",
        ops_on_tpu=on_tpu or 0,
        ops_on_cpu=on_cpu or 0,
        on_chip_bytes=size(r"On-chip memory used for caching model parameters:"),
        off_chip_bytes=size(r"Off-chip memory used for streaming uncached model parameters:"),
        text=text,
        on_chip_remaining_bytes=size(r"On-chip memory remaining for caching model parameters:"),
        ops=tuple(rows),
        partly_mapped=PARTLY_MAPPED.lower() in " ".join(text.split()).lower(),
        others_mapped=others_mapped,
    )


def mapping(ops: Sequence[str], log: CompileLog) -> Mapping:
    """The first op of `ops` (the uncompiled model, in execution order) that the compiler did not map.

    The mapped ops of a type all come before the cut and the unmapped ones after it, so the first
    `mapped(type)` ops of each type are mapped and the cut is the first op beyond its type's share:
    `mapped(type)` is the table's count of mapped ops of that type, or, when the table lists only the
    unmapped rows, the model's count less theirs; a type with no unmapped row is taken as mapped.
    The cut's status is the reason the table gives for its type, preferring a cause over "More than
    one subgraph is not supported" (which only says an op lies after the cut). Without a table the
    cut falls after the compiler's count of ops on the Edge TPU."""
    ops = tuple(ops)
    mapped, unmapped = Counter(), Counter()
    why: dict[str, str] = {}
    for row in log.ops:
        if row.mapped:
            mapped[row.operator] += row.count
        else:
            unmapped[row.operator] += row.count
            if row.operator not in why or (why[row.operator] == AFTER_THE_CUT and row.status != AFTER_THE_CUT):
                why[row.operator] = row.status
    total, seen = Counter(ops), Counter()
    for i, op in enumerate(ops):
        seen[op] += 1
        share = (total[op] - unmapped[op]) if log.others_mapped else mapped[op]
        if unmapped[op] and seen[op] > share:
            return Mapping(ops, i, why[op])
    if log.ops_on_cpu and log.ops_on_tpu < len(ops):
        return Mapping(ops, log.ops_on_tpu, "not mapped (the compiler's log names no operator for it)")
    return Mapping(ops, len(ops))


def leading_nodes(nodes: int, m: Mapping) -> int:
    """How many of a segment's `nodes` ONNX nodes (in topological order) stay on the Edge TPU when the
    compiler maps `m.on_tpu` of its `len(m.ops)` TFLite ops.

    An approximation: ONNX nodes and TFLite ops do not correspond one to one (the lowering fuses
    activations, adds PADs and reshapes), so the segment's nodes are split in the same proportion as its
    ops, round(nodes * on_tpu / ops), keeping at least one node on each side that has ops."""
    if m.on_tpu == 0 or nodes == 0:
        return 0
    if m.on_cpu == 0:
        return nodes
    share = math.floor(nodes * m.on_tpu / len(m.ops) + 0.5)
    return max(0, min(max(share, 1), nodes - 1))


def describe(correction: dict) -> str:
    """The build's warning for a segment the compiler maps only partly (a `correction` record)."""
    c = correction
    first = f"the first it cannot map is op {c['ops_on_tpu'] + 1} ({c['first_unmapped']}: {c['status']})"
    cost = f"predicted {c['predicted_ms_before']:.3f} -> {c['predicted_ms_after']:.3f} ms"
    if c["ops_on_tpu"] == 0:
        return (f"{c['segment']}: edgetpu_compiler mapped none of its {c['ops']} ops to the Edge TPU ({first}): "
                f"the bundle ships the uncompiled int8 model, which runs on the host CPU; {cost}")
    tail = "it runs" if c["ops_on_cpu"] == 1 else f"it and the {c['ops_on_cpu'] - 1} ops after it run"
    nodes = c["nodes_on_tpu"] + c["nodes_on_cpu"]
    return (f"{c['segment']}: edgetpu_compiler mapped {c['ops_on_tpu']} of {c['ops']} ops to the Edge TPU; {first}, "
            f"so {tail} on the host CPU (costed as the last {c['nodes_on_cpu']} of its {nodes} nodes, from "
            f"{c['first_cpu_node']}); {cost}")
