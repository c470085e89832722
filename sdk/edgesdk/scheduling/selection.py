"""Each CPU span of a plan on the fastest backend measured, as TensorRT times its tactics and Collage
chooses among backends.

A span is a run of consecutive plan segments on the host (the groups of its parallel steps included;
in a throughput plan, inside one pipeline stage): the schedule cut it by backend (TVM, onnxruntime for the ops TVM lacks) by the cost model, which
costs every CPU backend alike. Its candidates are the plan's own cut, and the whole span as one segment
on each CPU backend that lowers every node of it (`Backend.lowering`; TVM with the tuning database's
records, onnxruntime, LiteRT/XNNPACK fp32) among those `--cpu-backends` allows. Each candidate is
made a bundle of its own (its segments compiled by their backends, its parallel steps) and run by the
runtime's executor, as a device runs it; checked against onnxruntime on the float model (`TOLERANCE`
of each output's scale; a candidate that fails is skipped, with why); and timed: `ROUNDS` measurements
of each, the candidates in turn, each measurement a fresh process that loads the candidate alone (so
no other runtime's threads spin on the cores, as on a device) and times `RUNS` inferences after
`WARMUP`: the median of them all decides.

Timing happens on the build host when it runs the target's CPU code (the same architecture, no
instruction the host lacks); otherwise (an aarch64 target built on an x86-64 host) on a board over TVM
RPC where boards are given (`boards.py`: the same candidates, checks and rounds, each measurement a
session of its own on a board). Without boards nothing is timed and each span's backend is chosen by
policy (`by_policy`): the schedule's cut where the tuning database holds
tuned TVM records for all of its functions, else the whole span on LiteRT/XNNPACK (what ARM users run)
where it lowers every node and agrees with onnxruntime on this host, else the schedule's cut; the record
says why, with `measured_on: null`.

A measurement is kept in a timing cache (`TimingCache`, beside the tuning database, keyed by the segment's
bytes, the backend, the database's records it compiles with, the host CPU and the threads), so a
rebuild replays it: the same choice, the same bundle bytes. It replays times, never correctness: the
fastest candidate is built and checked again (an int8 one gated again) on every build, and one that
fails is dropped from the cache for the next fastest, which is checked in turn.

The chosen candidate's segments replace the span's in a new plan; a segment's predicted time becomes
its measured time, and the plan's predicted latency moves by the difference.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import onnx

from .. import backends
from ..config import HOST
from ..errors import UserError
from ..ir import model as irm
from ..ir.digest import tree_sha256
from ..ir.memory import give_back, shown
from ..runtime.files import NotRegularFile, open_regular, read_bounded, write_whole
from .plan import Plan, PlanSegment

CPU_BACKENDS = ("tvm", "onnxruntime", "litert")  # the candidates, in the order ties are broken
# with `--cpu-precision int8`, these int8 candidates besides (after their fp32 backend is allowed)
INT8_BACKENDS = {"litert": "litert-int8", "onnxruntime": "onnxruntime-int8"}
GATE_COSINE = 0.99  # an int8 candidate's least cosine similarity to fp32, per output, on held-out samples
GATE_TOP1 = 0.9  # and its least agreement of the arg max of a class-score output's last axis
PLANNED = "planned"  # the candidate that keeps the schedule's own cut
POLICY = "litert"  # where the target's CPU cannot be timed here: the whole span on LiteRT/XNNPACK, what ARM users run
ROUNDS = 3  # each candidate measured this many times, in turn, each time in a process of its own
RUNS = 10  # inferences per measurement, after WARMUP
WARMUP = 3
TOLERANCE = 1e-3  # of each output's scale (its largest magnitude): fp32 kernels that sum in another order
CHECK_SAMPLES = 2
# a candidate with more weights than this is checked in a process of its own (`_Apart`), as it is timed: a
# TVM library once loaded is never unloaded (its weights stayed held twice, the library's and the VM's,
# through the timing of every later candidate: 1.04 GiB for VGG16's); a smaller one is checked here, where
# a child's start (about a second) would cost more than its weights
CHECKED_APART_BYTES = 64 << 20

# what times a candidate: (its name, the measurement) -> milliseconds; tests give a fake one
Timer = Callable[[str, Callable[[], float]], float]


def measured(label: str, measure: Callable[[], float]) -> float:
    return measure()


@dataclass(frozen=True)
class Candidate:
    name: str  # PLANNED or a backend's name
    segments: tuple[PlanSegment, ...]  # how it cuts the span
    steps: tuple[tuple[str, ...], ...] = ()  # its segments that run at once (the plan's parallel steps)


@dataclass(frozen=True)
class Int8:
    """How int8 candidates are quantized and gated: the calibration samples (each the values of every
    tensor a CPU segment reads or writes), the held-out samples the accuracy gate compares on, and the
    calibration method; `digest` keys the timing cache (the artifact depends on all of it).

    A backend that can keep ops float (LiteRT) is given the gate's thresholds as its target on the
    calibration samples (mixed precision: `backends/tflite/mixed.py`); what its search kept float is
    remembered per segment graph (`mixed`), so the winner is quantized again without searching, and
    a rebuild replays it from the timing cache."""

    calibration: list[dict]
    held_out: list[dict]
    method: str
    percentile: float
    digest: str
    model_outputs: tuple[str, ...] = ()  # the gate's class-score outputs are among these
    log: Callable[[str], None] = lambda line: None
    mixed: dict[str, dict] = field(default_factory=dict)  # by backend and segment graph: the quantizer's "mixed" record

    def quantize(self, s: PlanSegment, model: onnx.ModelProto, out_dir: Path) -> dict:
        """`s` quantized by its backend into `out_dir`: the quantizer's record."""
        key = _mixed_key(s, model)
        known = self.mixed.get(key)
        record = backends.backend(s.backend).quantize(backends.QuantizeJob(
            segment=s, model=model, samples=[{k: v[k] for k in (*s.inputs, *s.outputs)} for v in self.calibration],
            out_dir=out_dir, method=self.method, percentile=self.percentile, log=self.log,
            target=backends.AccuracyTarget(GATE_COSINE, GATE_TOP1, tuple(o for o in s.outputs if o in self.model_outputs)),
            keep_float=tuple(known["float_ops"]) if known else None))
        if "mixed" in record and not known:
            self.mixed[key] = record["mixed"]
        return record

    def mixed_of(self, cand: Candidate, models: dict[str, onnx.ModelProto]) -> dict | None:
        """What the search kept float in a candidate's segment (`models`: its graphs), if it kept any."""
        found = [self.mixed.get(_mixed_key(s, models[s.id])) for s in cand.segments]
        return next((m for m in found if m and m["float_ops"]), None)

    def remember(self, cand: Candidate, models: dict[str, onnx.ModelProto], mixed: dict) -> None:
        for s in cand.segments:
            self.mixed[_mixed_key(s, models[s.id])] = mixed


def _mixed_key(s: PlanSegment, model: onnx.ModelProto) -> str:
    return f"{s.backend}:{irm.sha256(model)}"


@dataclass(frozen=True)
class Selected:
    plan: Plan
    models: dict[str, onnx.ModelProto]  # the segments the selection cut anew, by id
    record: dict  # the plan's `cpu_selection`
    # the int8 segments chosen, by id: their quantizer's record (artifact relative to `int8_dir`, specs, accuracy)
    quantized: dict[str, dict] = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # the samples they were calibrated on (the tune stage's record)


# a timing cache holds well under a kilobyte per candidate measured: 64 MiB is far past any real one
CACHE_MAX_BYTES = 64 << 20
CACHE_HINT = ("the timing cache only saves measuring again: remove the file, or point --tuning-db at another "
              "directory; the next build measures the candidates anew")


class TimingCache:
    """Measured medians by key, in one JSON file written whole (temporary file, then rename).

    It replays what an earlier build measured, never what it checked: the tune stage checks the candidate
    it chooses on every build (`_measure_span`). A file that is not a regular file of at most
    `CACHE_MAX_BYTES`, not JSON, or holds an entry of another shape is refused (`tune.timing-cache`)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = _read_cache(path)

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.entries, indent=1, sort_keys=True) + "\n"
        # through a fresh temporary: the database may be a shared directory where a link was planted
        write_whole(self.path, lambda f: f.write(text.encode()))


def _read_cache(path: Path) -> dict[str, dict]:
    """The cache's entries: {} where the file does not exist. Opened without blocking (a FIFO planted as
    the file would wait for a writer for ever), then refused unless a regular file of a bounded size."""
    def refused(why: str) -> UserError:
        return UserError("tune.timing-cache", f"the timing cache {path}: {why}", hint=CACHE_HINT)

    try:
        with open_regular(path, CACHE_MAX_BYTES) as f:
            raw = read_bounded(f, CACHE_MAX_BYTES)
    except FileNotFoundError:
        return {}
    except NotRegularFile as e:
        raise refused(str(e)) from None
    except OSError as e:
        raise refused(f"cannot be read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        raise refused(f"is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise refused(f"is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise refused("is not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise refused(f"holds a JSON {_json_kind(data)}, not an object of entries")
    for key, entry in data.items():
        why = _entry_problem(entry)
        if why is not None:
            at = text.find(json.dumps(key))
            line = f"line {text[:at].count(chr(10)) + 1}: " if at >= 0 else ""
            name = key if len(key) <= 20 else key[:16] + "..."
            raise refused(f"{line}entry {name!r}: {why}")
    return data


def _json_kind(x) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(x), "null")


def _finite(x, low: float = -math.inf, high: float = math.inf) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high


def _entry_problem(entry) -> str | None:
    """Why a timing cache entry is not one `TimingCache.put` writes (None where it is):
    {"skipped": why} or {"ms": milliseconds, "gate": ..., "mixed": ...}."""
    if not isinstance(entry, dict):
        return f"is a JSON {_json_kind(entry)}, not an object"
    if "skipped" in entry:
        if set(entry) != {"skipped"} or not isinstance(entry["skipped"], str):
            return "a skipped candidate's entry holds its reason (text) alone"
        return None
    unknown = sorted(set(entry) - {"ms", "gate", "mixed"})
    if unknown:
        return f"unknown key {unknown[0]!r}"
    if "ms" not in entry:
        return "no 'ms' (the measured milliseconds) and no 'skipped'"
    if not _finite(entry["ms"], 0.0) or entry["ms"] <= 0:
        return f"'ms' is {json.dumps(entry['ms'])}, not a finite positive number of milliseconds"
    gate = entry.get("gate")
    if gate is not None:
        if not isinstance(gate, dict) or set(gate) != {"cosine", "top1", "samples"}:
            return "'gate' is not an object of cosine, top1 and samples"
        if not _finite(gate["cosine"], -1.0, 1.0):
            return f"'gate.cosine' is {json.dumps(gate['cosine'])}, not a number in [-1, 1]"
        if gate["top1"] is not None and not _finite(gate["top1"], 0.0, 1.0):
            return f"'gate.top1' is {json.dumps(gate['top1'])}, not null or a number in [0, 1]"
        if not _count(gate["samples"]):
            return f"'gate.samples' is {json.dumps(gate['samples'])}, not a count"
    mixed = entry.get("mixed")
    if mixed is not None:
        figures = ("calibration_cosine", "calibration_top1")  # what the search reached, where it searched
        if (not isinstance(mixed, dict) or set(mixed) - {"float_ops", "ops", *figures}
                or not _count(mixed.get("ops")) or not isinstance(mixed.get("float_ops"), list)
                or not all(isinstance(f, str) for f in mixed["float_ops"])
                or any(mixed.get(k) is not None and not _finite(mixed[k]) for k in figures)):
            return "'mixed' is not an object of float_ops (op names) and ops (a count)"
    return None


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def unmeasurable(target) -> str | None:
    """Why this host cannot time the target's CPU code (another architecture, or instructions this
    host lacks); None where it can."""
    from ..backends.tvm import missing_host_features, target_arch

    codegen = target.host.codegen
    arch = target_arch(codegen)
    if arch != platform.machine():
        return f"the target's CPU is {arch}, this host {platform.machine()}"
    missing = missing_host_features(codegen)
    if missing:
        return f"this host's CPU lacks {', '.join(missing[:4])} of the target's"
    return None


def host_name() -> str:
    """This host's CPU: its model name and the name LLVM gives it."""
    from ..backends.tvm import host_cpu

    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
                 platform.processor() or platform.machine())
    return f"{model} ({host_cpu()[0]}, {os.cpu_count()} cores)"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def spans(plan: Plan) -> list[tuple[int, int]]:
    """The CPU spans as index ranges [i, j) of the plan's segments (a parallel step's groups included).
    A throughput plan's stages are the pipelining DP's choice, so a span stays inside one; a latency
    plan streams segment by segment."""
    stage_of = ({sid: k for k, stage in enumerate(plan.pipeline_stages) for sid in stage}
                if plan.mode == "throughput" else {})
    out, i, segs = [], 0, plan.segments
    while i < len(segs):
        if segs[i].device != HOST:
            i += 1
            continue
        j = i + 1
        while j < len(segs) and segs[j].device == HOST and stage_of.get(segs[j].id) == stage_of.get(segs[i].id):
            j += 1
        out.append((i, j))
        i = j
    return out


def kept_float(plan: Plan, nodes: Sequence[str]) -> str:
    """Why a span holding a node the plan keeps in float on the CPU (`Plan.keep_on_cpu`: the accuracy remedy's
    culprits, `--keep-on-cpu`) has no int8 candidate; "" where it holds none."""
    pinned = [n for n in nodes if n in (plan.keep_on_cpu or {}).get("segments", {})]
    return (f"{', '.join(pinned[:3])}{' ...' if len(pinned) > 3 else ''} kept in float on the cpu for accuracy "
            "(plan.json keep_on_cpu)") if pinned else ""


def candidates(plan: Plan, span: tuple[int, int], model: onnx.ModelProto, allowed: Sequence[str]
               ) -> tuple[list[Candidate], dict[str, str]]:
    """The plan's cut and each allowed backend's whole span; the backends left out, and why."""
    segs = plan.segments[span[0]:span[1]]
    index = {irm.node_name(n, i): i for i, n in enumerate(model.graph.node)}
    nodes = [n for s in segs for n in s.nodes]
    shapes, consts = irm.static_shapes(model), irm.constant_names(model)
    produced = {t for s in segs for t in s.outputs}
    outside = {t for s in plan.segments if s not in segs for t in s.inputs}
    needed = outside | set(plan.outputs) | set(plan.probes.values())
    inputs = tuple(dict.fromkeys(t for s in segs for t in s.inputs if t not in produced))
    outputs = tuple(t for s in segs for t in s.outputs if t in needed)
    ids = {s.id for s in segs}
    found = [Candidate(PLANNED, segs, tuple(st for st in plan.parallel_steps if set(st) <= ids))]
    skipped: dict[str, str] = {}
    pinned = kept_float(plan, nodes)
    for name in allowed:
        if len(segs) == 1 and segs[0].backend == name:
            continue  # the plan's cut is this candidate already
        if pinned and name in INT8_BACKENDS.values():
            skipped[name] = pinned
            continue
        check = backends.backend(name).lowering_check()
        why = next((f"{n}: {w}" for n in nodes if (w := check(model.graph.node[index[n]], shapes, consts))), None)
        if why is not None:
            skipped[name] = f"cannot lower {why}"
            continue
        whole = PlanSegment(segs[0].id, HOST, name, f"segments/{segs[0].id}.onnx", tuple(nodes), inputs, outputs,
                            sum(s.flops for s in segs), sum(s.param_bytes for s in segs),
                            round(sum(s.predicted_ms for s in segs), 4))
        found.append(Candidate(name, (whole,)))
    return found, skipped


def select(plan: Plan, model: onnx.ModelProto, segment_models: Callable[[PlanSegment], onnx.ModelProto], target,
           samples: list[dict], *, allowed: Sequence[str], tuning_db: Path, cache: TimingCache,
           measurable: str | None, host: str, log: Callable[[str], None], timer: Timer = measured,
           precision: str = "fp32", calib_method: str = "minmax", calib_percentile: float = 99.99,
           int8_dir: Path | None = None, boards: backends.Boards | None = None, board: dict | None = None,
           only: Sequence[str] | None = None) -> Selected:
    """The plan with every CPU span on its fastest candidate. `measurable` is None where this host can
    time the target's CPU code, else why not (then the candidates are chosen by policy, `by_policy`,
    and `model` and `samples` are needed only where `litert` is allowed); `samples` are inputs of the
    whole model; `host` names this host's CPU (and keys the timing cache). With `precision` "int8", the
    int8 variants of the allowed backends (`INT8_BACKENDS`) are candidates too, quantized on the
    calibration share of `samples` and gated on the held-out rest (`held_out_split`); each one chosen
    is quantized again, as measured, into `int8_dir` (its `segments/`) for the package stage.

    Where this host cannot time the target's CPU code and `boards` (`--rpc-tracker`, `--rpc-key`) are
    given, the candidates are checked and timed on a board (`scheduling/boards.py`) instead of chosen by
    policy; `host` then names the board's CPU (`board`: what the board said of itself, asked if not given).
    With `only` (`--low-memory`), a candidate with a segment another backend compiles is left out, and
    a span left with one candidate other than the plan's cut takes it unbuilt and untimed."""
    found = spans(plan)
    if precision == "int8":
        allowed = [*allowed, *(INT8_BACKENDS[b] for b in allowed if b in INT8_BACKENDS)]
    record: dict = {"candidates": list(allowed), "measured_on": host, "spans": []}
    if precision == "int8":
        record["precision"] = "int8"
    if not found:
        record = {**record, "note": "no CPU segment"}
        return Selected(replace(plan, cpu_selection=record), {}, record)
    int8 = None
    if precision == "int8" and model is not None and any(b in INT8_BACKENDS.values() for b in allowed):
        calib, held = held_out_split(samples)
        int8 = Int8(_reference(model, calib, plan), _reference(model, held, plan), calib_method, calib_percentile,
                    _samples_digest(samples, calib_method, calib_percentile), tuple(plan.outputs), log)
        record["gate"] = {"cosine": GATE_COSINE, "top1": GATE_TOP1, "calibration_samples": len(calib),
                          "held_out_samples": len(held) if held is not calib else 0}
    threads = min(target.host.cores, os.cpu_count() or 1)
    if measurable is not None and boards is not None:  # timed on a board instead
        from . import boards as on_boards

        board = board or on_boards.describe(boards)
        host = on_boards.name(board, boards)
        record["measured_on"] = f"{host} via {boards.host}:{boards.port}"
        threads = min(target.host.cores, int(board["cores"]))
        log(f"tune: CPU candidates are timed on {host}")
        measurable = None
    if measurable is not None:  # this host cannot time the target's CPU code: chosen by policy
        chosen_plan, models, record = by_policy(plan, model, segment_models, target, samples, allowed=allowed,
                                                tuning_db=tuning_db, unmeasured=measurable, log=log, int8=int8,
                                                record=record)
        return Selected(chosen_plan, models, record, _quantize_chosen(chosen_plan, models, int8, int8_dir, log))
    values = _reference(model, samples[:CHECK_SAMPLES], plan)
    for var in ("TVM_NUM_THREADS", "EDGESDK_NUM_THREADS"):  # as the bundle's executor sizes the runners
        os.environ.setdefault(var, str(threads))

    chosen: dict[tuple[int, int], tuple[Candidate, float | None]] = {}
    models: dict[str, onnx.ModelProto] = {}
    with tempfile.TemporaryDirectory(prefix="edgesdk-select-") as tmp:
        for span in found:
            cands, skipped = candidates(plan, span, model, allowed)
            if only is not None and any(b not in only for c in cands for b in (s.backend for s in c.segments)):
                kept = [c for c in cands if all(s.backend in only for s in c.segments)]
                skipped.update({c.name: f"--low-memory: compiled by {', '.join(sorted({s.backend for s in c.segments}))}"
                                for c in cands if c not in kept})
                cands = kept or cands[:1]  # none left: the plan's cut, as scheduled
                if cands[0].name != PLANNED and len(cands) == 1:  # the one left, not built here: nothing to time
                    chosen[span] = cands[0], None
                    models.update({s.id: _extract(model, s) for s in cands[0].segments})
                    record["spans"].append(_unmeasured(cands[0], skipped, "the only candidate (--low-memory)"))
                    log(f"tune: span of {record['spans'][-1]['nodes']} nodes: {cands[0].name}, the only candidate "
                        "(--low-memory)")
                    continue
            if len(cands) == 1:  # nothing to choose between: no build, no timing
                record["spans"].append(_unmeasured(cands[0], skipped, "the only candidate"))
                continue
            entry, winner, ms, cut = _measure_span(cands, skipped, model, segment_models, target, values, int8,
                                                   plan.outputs, Path(tmp), tuning_db, cache, host, threads, log,
                                                   timer, boards)
            record["spans"].append(entry)
            chosen[span] = winner, ms
            models.update(cut)
    new = replace(_replan(plan, chosen), cpu_selection=record)
    return Selected(new, models, record, _quantize_chosen(new, models, int8, int8_dir, log))


def _unmeasured(cand: Candidate, skipped: dict[str, str], why: str) -> dict:
    """The record of a span whose one candidate is taken without being built or timed."""
    return {"segments": [s.id for s in cand.segments], "nodes": sum(len(s.nodes) for s in cand.segments),
            "candidates": {name: {"skipped": reason} for name, reason in skipped.items()}, "chosen": cand.name,
            "why": why}


def _quantize_chosen(plan: Plan, models: dict[str, onnx.ModelProto], int8: Int8 | None, int8_dir: Path | None,
                     log: Callable[[str], None]) -> dict[str, dict]:
    """Each int8 CPU segment of the chosen plan quantized again, as its candidate was, into `int8_dir`:
    its quantizer's records by segment id."""
    quantized = {}
    for s in plan.segments:
        b = backends.backend(s.backend)
        if s.device == HOST and b.quantizes and int8 is not None and int8_dir is not None:
            (int8_dir / "segments").mkdir(parents=True, exist_ok=True)
            log(f"tune: {s.id}: quantizing for {s.backend} on {len(int8.calibration)} calibration samples")
            quantized[s.id] = int8.quantize(s, models[s.id], int8_dir / "segments")
    return quantized


def by_policy(plan: Plan, model: onnx.ModelProto | None, segment_models: Callable[[PlanSegment], onnx.ModelProto],
              target, samples: list[dict], *, allowed: Sequence[str], tuning_db: Path, unmeasured: str,
              log: Callable[[str], None], int8: Int8 | None = None,
              record: dict | None = None) -> tuple[Plan, dict[str, onnx.ModelProto], dict]:
    """The plan with each CPU span's backend chosen by policy, where this host cannot time the target's
    CPU code (`unmeasured` says why: an aarch64 target built on an x86-64 host). Per span:

    1. the schedule's cut where its TVM kernels are tuned: the database holds tuned records for every
       function of its TVM segments (for a foreign CPU, only a search measured on the boards over RPC
       writes them: tuning the user paid for);
    2. else the whole span on LiteRT/XNNPACK (`POLICY`, what ARM users run), where it lowers every node
       and its output agrees with onnxruntime on the float model (`_check`, on this host: TFLite's fp32
       kernels compute the same function on every CPU, within TOLERANCE);
    3. else the schedule's cut (TVM's untuned kernels), with why.

    With `int8` (`--cpu-precision int8`, `litert-int8` allowed), step 2 tries LiteRT's int8 first, where
    it passes the accuracy gate on the held-out samples (`gate`, on this host: the int8 kernels'
    arithmetic is specified to the bit), and falls back to fp32 LiteRT with why.

    `--cpu-backends` still restricts: without `litert` in `allowed`, every span keeps the schedule's
    cut. `model` and `samples` are needed only where `litert` is allowed. Nothing is timed: the segments
    keep the cost model's predictions, and the record says `measured_on: null`. Returns the plan, the
    segments it cut anew, and the record (`record`'s keys kept)."""
    record = {**(record or {}), "candidates": list(allowed), "measured_on": None,
              "note": f"not measured ({unmeasured}): chosen by policy", "spans": []}
    chosen: dict[tuple[int, int], tuple[Candidate, float | None]] = {}
    models: dict[str, onnx.ModelProto] = {}
    values: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="edgesdk-policy-") as tmp:
        for span in spans(plan):
            segs = plan.segments[span[0]:span[1]]
            ids = [s.id for s in segs]
            label = ids[0] if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
            planned = Candidate(PLANNED, segs, tuple(st for st in plan.parallel_steps if set(st) <= set(ids)))
            considered: dict[str, dict] = {PLANNED: {"policy": "the schedule's cut"}}
            winner, why = planned, "the schedule's cut"
            litert = None
            if POLICY in allowed:
                cands, skipped = candidates(plan, span, model, [POLICY])
                litert = next((c for c in cands if c.name == POLICY), None)
                if litert is None:
                    considered[POLICY] = {"skipped": skipped[POLICY]}
                    why += f" ({POLICY}: {skipped[POLICY]})"
            if litert is not None:  # the schedule's cut tuned for this target, or LiteRT where it agrees
                untuned = _untuned(planned, segment_models, target, tuning_db)
                if untuned is None:
                    considered[PLANNED] = {"policy": "TVM's kernels tuned"}
                    considered[POLICY] = {"policy": "not built: the schedule's cut is tuned"}
                    why = "TVM's kernels of the schedule's cut are tuned"
                else:
                    considered[PLANNED] = {"policy": f"untuned: {untuned}"}
                    values = values or _reference(model, samples[:CHECK_SAMPLES], plan)
                    tried = ([INT8_BACKENDS[POLICY]] if int8 is not None and INT8_BACKENDS[POLICY] in allowed
                             and not kept_float(plan, [n for s in segs for n in s.nodes]) else [])
                    failed = ""
                    for name in [*tried, POLICY]:
                        cand = replace(litert, name=name, segments=tuple(replace(s, backend=name) for s in litert.segments))
                        cut = {s.id: _extract(model, s) for s in cand.segments}
                        try:
                            bundle = _open(cand, cut, target, Path(tmp) / f"{label}-{name}", tuning_db,
                                           int8 if name != POLICY else None)
                            try:
                                gated = _gated(bundle, int8, cand, cut, plan.outputs) if name != POLICY else None
                                if gated is None:
                                    _check(cand, bundle, values)
                            finally:
                                bundle.close()
                        except Exception as e:  # noqa: BLE001 -- one that does not build, run or agree is never chosen
                            considered[name] = {"skipped": _short(e)}
                            failed += f" ({name}: {_short(e)})"
                            continue
                        if gated is not None:
                            found = int8.mixed_of(cand, cut)
                            considered[name] = {"policy": "lowers every node; passes the accuracy gate", "gate": gated,
                                                **({"mixed": _mixed_entry(found)} if found else {})}
                            winner, why = cand, "LiteRT int8 lowers every node and passes the accuracy gate"
                        else:
                            considered[name] = {"policy": "lowers every node; agrees with onnxruntime"}
                            winner, why = cand, "LiteRT lowers every node" + failed
                        models.update(cut)
                        break
                    else:
                        why += failed
            entry = {"segments": ids, "nodes": sum(len(s.nodes) for s in segs), "candidates": considered,
                     "chosen": winner.name, "why": f"policy: {why}; not measured: {unmeasured}"}
            record["spans"].append(entry)
            log(f"tune: {label} ({entry['nodes']} nodes): {winner.name}, policy: {why}")
            chosen[span] = winner, None
    return replace(_replan(plan, chosen), cpu_selection=record), models, record


def _untuned(cand: Candidate, segment_models: Callable[[PlanSegment], onnx.ModelProto], target,
             tuning_db: Path) -> str | None:
    """Why a cut's kernels are not all tuned (None when every segment's backend tunes and the database
    holds tuned records for all of their functions)."""
    by_backend: dict[str, list[PlanSegment]] = {}
    for s in cand.segments:
        by_backend.setdefault(s.backend, []).append(s)
    for name, segs in by_backend.items():
        try:
            why = backends.backend(name).untuned(tuple(segment_models(s) for s in segs), target.host, tuning_db)
        except Exception as e:  # noqa: BLE001 -- informational: a segment TVM cannot import fails where it is compiled
            why = f"could not tell: {_short(e)}"
        if why is not None:
            return why
    return None


def _measure_span(cands: list[Candidate], skipped: dict[str, str], model, segment_models, target, values: list[dict],
                  int8: Int8 | None, model_outputs: Sequence[str], work: Path, tuning_db: Path, cache: TimingCache,
                  host: str, threads: int, log, timer: Timer, boards: backends.Boards | None = None):
    """Compile, check and time one span's candidates (or replay their times from the cache), here or with
    `boards` on a board: the span's record, the winner, its measured time, and the segment models the
    winner cuts anew. The winner is always a candidate checked by this build (`_recheck` where its time
    was replayed)."""
    ids = [s.id for s in cands[0].segments]
    label = ids[0] if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
    entry: dict = {"segments": ids, "nodes": sum(len(s.nodes) for s in cands[0].segments),
                   "candidates": {name: {"skipped": why} for name, why in skipped.items()}}
    runnable: dict[str, tuple[Candidate, object]] = {}
    cut: dict[str, dict[str, onnx.ModelProto]] = {}
    keys: dict[str, str] = {}
    times: dict[str, float] = {}
    gates: dict[str, dict] = {}
    replayed: list[str] = []
    extracted: dict[tuple, onnx.ModelProto] = {}

    def shared(s: PlanSegment) -> onnx.ModelProto:
        """Candidates that cut the same segment share one model (one copy of its weights)."""
        key = (tuple(s.nodes), tuple(s.inputs), tuple(s.outputs))
        if key not in extracted:
            extracted[key] = _extract(model, s)
        return extracted[key]

    for cand in cands:
        cut[cand.name] = {s.id: segment_models(s) if cand.name == PLANNED else shared(s) for s in cand.segments}
        quantized = _quantizes(cand)
        keys[cand.name] = _key(cand, cut[cand.name], tuning_db, host, threads, int8.digest if quantized else "")
        hit = cache.get(keys[cand.name])
        if hit is not None:  # measured by an earlier build on this host: replayed, so the bundle is the same bytes
            if "skipped" in hit:
                entry["candidates"][cand.name] = {"skipped": hit["skipped"]}
            else:
                times[cand.name] = hit["ms"]
                if "gate" in hit:
                    gates[cand.name] = hit["gate"]
                if "mixed" in hit:
                    int8.remember(cand, cut[cand.name], hit["mixed"])
            replayed.append(cand.name)
            continue
        try:
            bundle = _open(cand, cut[cand.name], target, work / cand.name, tuning_db, int8 if quantized else None,
                           boards)
            if quantized:  # int8: the accuracy gate against fp32 on held-out samples, instead of fp32's tolerance
                gates[cand.name] = _gated(bundle, int8, cand, cut[cand.name], model_outputs)
            else:
                _check(cand, bundle, values)
        except Exception as e:  # a candidate that does not build, run or agree is never chosen
            entry["candidates"][cand.name] = {"skipped": _short(e)}
            cache.put(keys[cand.name], {"skipped": _short(e)})
            log(f"tune: {label}: {cand.name} skipped: {_short(e)}")
            bundle = None
            give_back()
            continue
        runnable[cand.name] = cand, _released(bundle)
        bundle = None
        give_back()  # what its compiler and runtime freed, before the next candidate compiles
    on_board = None
    if boards is not None:
        from .boards import measure

        on_board = partial(measure, boards)
    measured, failed = _time(runnable, values[0], timer, work, on_board)
    mixed = {name: found for name, (cand, _) in runnable.items() if name in gates
             and (found := int8.mixed_of(cand, cut[name]))}
    for name, ms in measured.items():
        cache.put(keys[name], {"ms": ms, **({"gate": gates[name]} if name in gates else {}),
                               **({"mixed": mixed[name]} if name in mixed else {})})
        times[name] = ms
    for name, why in failed.items():  # built and checked, but its timing run failed: never chosen
        entry["candidates"][name] = {"skipped": why}
        log(f"tune: {label}: {name} skipped: {why}")
    # the cache replays times, never correctness: the fastest is checked unless this build checked it already,
    # and one that fails (an entry planted, or measured by a build whose check has since changed) is dropped
    order = [c.name for c in cands]
    best = None
    for name in sorted(times, key=lambda n: (times[n], order.index(n))):
        if name in runnable:
            best = name
            break
        cand = next(c for c in cands if c.name == name)
        try:
            checked = _recheck(cand, cut[name], target, work / name, tuning_db, int8 if _quantizes(cand) else None,
                               boards, values, model_outputs)
        except Exception as e:  # noqa: BLE001 -- one that does not build, run or agree is never chosen
            del times[name]
            gates.pop(name, None)
            entry["candidates"][name] = {"skipped": _short(e)}
            cache.put(keys[name], {"skipped": _short(e)})
            log(f"tune: {label}: {name} skipped: {_short(e)} (its time was replayed from the timing cache)")
            give_back()
            continue
        if checked is not None and gates.get(name) != checked:  # the gate's figures as measured now
            gates[name] = checked
            cache.put(keys[name], {**cache.get(keys[name]), "gate": checked})
        best = name
        break
    if best is None:  # nothing could be measured: the plan stays as the cost model made it
        entry["chosen"], entry["why"] = PLANNED, "no candidate could be measured"
        return entry, cands[0], None, {}
    for name, ms in times.items():
        found = int8.mixed_of(next(c for c in cands if c.name == name), cut[name]) if name in gates else None
        entry["candidates"][name] = {"ms": ms, **({"gate": gates[name]} if name in gates else {}),
                                     **({"mixed": _mixed_entry(found)} if found else {})}
    others = ", ".join(f"{n} {times[n]:.3f} ms" for n in sorted(times, key=times.get) if n != best)
    entry["chosen"] = best
    entry["why"] = f"fastest measured: {times[best]:.3f} ms" + (f", against {others}" if others else "")
    log(f"tune: {label} ({entry['nodes']} nodes): {best}, {entry['why']}"
        + (f" ({', '.join(replayed)} replayed from the timing cache)" if replayed else ""))
    winner = next(c for c in cands if c.name == best)
    return entry, winner, times[best], ({} if best == PLANNED else cut[best])


def _recheck(cand: Candidate, models: dict[str, onnx.ModelProto], target, work: Path, tuning_db: Path,
             int8: Int8 | None, boards: backends.Boards | None, values: list[dict],
             model_outputs: Sequence[str]) -> dict | None:
    """A candidate whose time was replayed, built and checked as a measured one is: against onnxruntime
    (None), or an int8 one through the accuracy gate on the held-out samples (its figures). Raises where
    it does not build, run or pass."""
    bundle = _open(cand, models, target, work, tuning_db, int8, boards)
    try:
        if int8 is not None:
            return _gated(bundle, int8, cand, models, model_outputs)
        _check(cand, bundle, values)
        return None
    finally:
        bundle.close()


@dataclass(frozen=True)
class _Checked:
    """A candidate bundle that was opened and checked: what timing it needs (`_time`)."""
    bundle: Path
    inputs: tuple

    def close(self) -> None:
        pass


def _released(bundle):
    """A checked candidate's runtime let go (each is timed in a process of its own): the candidates'
    weights are never all held at once."""
    from ..runtime.executor import BundleModel

    if not isinstance(bundle, BundleModel):  # a board's handle, or a bundle checked apart, holds nothing here
        return bundle
    bundle.close()
    return _Checked(bundle.bundle, tuple(bundle.inputs))


def _open(cand: Candidate, models: dict[str, onnx.ModelProto], target, work: Path, tuning_db: Path,
          int8: Int8 | None = None, boards: backends.Boards | None = None):
    """The candidate as a bundle of its own in `work` (`_write`), opened by the runtime's executor, which
    times what a device runs (past `CHECKED_APART_BYTES` of weights, a handle that runs it in a process
    of its own, `_Apart`); with `boards`, a handle that runs it on a board (`boards.OnBoard`)."""
    from ..runtime.executor import BundleModel

    manifest = _write(cand, models, target, work, tuning_db, int8)
    if boards is not None:
        from .boards import OnBoard

        return OnBoard(boards, work, manifest)
    if sum(irm.weight_bytes(m) for m in models.values()) > CHECKED_APART_BYTES:
        give_back()  # what the compilers freed, before the child that runs it loads its weights
        return _Apart(work, manifest.inputs, manifest.outputs)
    return BundleModel(work, log=lambda line: None)


@dataclass(frozen=True)
class _Apart:
    """A candidate bundle never loaded by the build: `run_all` runs it in a process of its own (see
    `CHECKED_APART_BYTES`), as `measure_alone` times it."""
    bundle: Path
    inputs: tuple
    outputs: tuple

    def run_all(self, feeds: list[dict]) -> list[dict]:
        with tempfile.TemporaryDirectory(prefix="check-", dir=self.bundle.parent) as tmp:
            given, got = Path(tmp) / "feeds.npz", Path(tmp) / "outputs.npz"
            np.savez(given, **{f"{i}|{name}": value for i, f in enumerate(feeds) for name, value in f.items()})
            done = subprocess.run([sys.executable, "-c", _RUN_CHILD, str(self.bundle), str(given), str(got)],
                                  capture_output=True, text=True, env=_child_env(), timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"its run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            outputs: list[dict] = [{} for _ in feeds]
            with np.load(got) as values:
                for key in values.files:
                    i, name = key.split("|", 1)
                    outputs[int(i)][name] = values[key]
            return outputs

    def close(self) -> None:
        pass


_RUN_CHILD = """
import sys
import numpy as np
from edgesdk.runtime import BundleModel
model = BundleModel(sys.argv[1], log=lambda s: None)
feeds = {}
with np.load(sys.argv[2]) as given:
    for key in given.files:
        i, name = key.split("|", 1)
        feeds.setdefault(int(i), {})[name] = given[key]
np.savez(sys.argv[3], **{f"{i}|{name}": value for i in sorted(feeds) for name, value in model.run(feeds[i]).items()})
"""


def _write(cand: Candidate, models: dict[str, onnx.ModelProto], target, work: Path, tuning_db: Path,
           int8: Int8 | None = None):
    """The candidate's bundle written in `work`: each segment compiled by its backend (one that quantizes
    first quantized, as the compress stage will, on `int8`'s calibration samples), a manifest with its
    parallel steps. Returns the manifest."""
    from .. import __version__
    from ..runtime import manifest as mf

    (work / "segments").mkdir(parents=True, exist_ok=True)
    segments, specs = [], {}
    for s in cand.segments:
        b = backends.backend(s.backend)
        compressed = None
        if b.quantizes:
            (work / "quantized" / "segments").mkdir(parents=True, exist_ok=True)
            compressed = {**int8.quantize(s, models[s.id], work / "quantized" / "segments"),
                          "dir": str(work / "quantized")}
        compiled = b.compile(backends.CompileJob(segment=s, model=models[s.id], device=target.host,
                                                 segments_dir=work / "segments", tuning_db=tuning_db,
                                                 compressed=compressed, twin_dir=work / "twin", log=lambda line: None,
                                                 keep_kernel_times=True))
        segments.append(mf.Segment(id=s.id, device=HOST, backend=b.runner, artifact=compiled.artifact,
                                   inputs=compiled.inputs, outputs=compiled.outputs, nodes=len(s.nodes),
                                   threads=s.threads))
        specs.update({t.name: t for t in (*compiled.inputs, *compiled.outputs)})
    produced = {t.name for seg in segments for t in seg.outputs}
    inputs = tuple(dict.fromkeys(t.name for seg in segments for t in seg.inputs if t.name not in produced))
    manifest = mf.Manifest(
        schema_version=mf.SCHEMA_VERSION, sdk_version=__version__, min_runtime_version=mf.RUNTIME_VERSION,
        model={"name": f"candidate {cand.name}"}, target={"name": target.name}, arch=target.host.arch,
        device_map={HOST: HOST}, inputs=tuple(_plain_spec(specs[t]) for t in inputs),
        outputs=tuple(_plain_spec(specs[t]) for t in dict.fromkeys(o for s in cand.segments for o in s.outputs)),
        segments=tuple(segments), pipeline_stages=(tuple(s.id for s in segments),), predicted={},
        parallel_steps=cand.steps, cpu_threads=target.host.cores)
    (work / "manifest.json").write_text(manifest.to_json())
    return manifest


def _plain_spec(t):
    """A segment's tensor as the candidate's own input or output: in the model's layout and dtype."""
    from ..runtime.manifest import TensorSpec

    return TensorSpec(name=t.name, shape=t.shape, dtype=t.dtype)


def _check(cand: Candidate, bundle, samples: list[dict], tolerance: float | None = None) -> None:
    """Every output the span hands on, within `tolerance` (TOLERANCE) of its scale (its largest magnitude)
    of onnxruntime on the float model; raises ValueError saying which output is off and by how much."""
    tolerance = TOLERANCE if tolerance is None else tolerance
    for sample, got in zip(samples, _run_all(bundle, samples)):
        for t in bundle.outputs:
            want = sample[t.name].astype(np.float64)
            err = float(np.max(np.abs(got[t.name].astype(np.float64) - want))) if want.size else 0.0
            scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)
            if not np.isfinite(err) or err > tolerance * scale:
                raise ValueError(f"its {t.name} differs from onnxruntime by {err:.3g} (scale {scale:.3g})")


def _run_all(bundle, samples: list[dict]) -> list[dict]:
    """The bundle's outputs on each sample (a candidate on a board runs them all in one session)."""
    feeds = [{t.name: sample[t.name] for t in bundle.inputs} for sample in samples]
    if hasattr(bundle, "run_all"):
        return bundle.run_all(feeds)
    return [bundle.run(f) for f in feeds]


def gate(bundle, held_out: list[dict], model_outputs: Sequence[str]) -> dict:
    """An int8 candidate against the fp32 model on held-out samples: each output's cosine similarity
    over the samples, and for the model's class-score outputs (rank 2 or 3, a last axis of 2 or more)
    how often the arg max of the last axis agrees. Raises where the least cosine is under GATE_COSINE
    or an agreement under GATE_TOP1; else the figures (the least of each)."""
    from ..ir.numeric import fidelity

    cosines, agreements = fidelity(_run_all(bundle, held_out), held_out, model_outputs)
    worst = min(cosines, key=cosines.get)
    if cosines[worst] < GATE_COSINE:
        raise ValueError(f"accuracy gate: {worst}'s cosine similarity to fp32 is {cosines[worst]:.4f} < {GATE_COSINE} "
                         f"on {len(held_out)} held-out samples")
    result: dict = {"cosine": cosines[worst], "top1": None, "samples": len(held_out)}
    if agreements:
        least = min(agreements, key=agreements.get)
        if agreements[least] < GATE_TOP1:
            raise ValueError(f"accuracy gate: {least}'s top-1 agrees with fp32 on {agreements[least]:.0%} < "
                             f"{GATE_TOP1:.0%} of {len(held_out)} held-out samples")
        result["top1"] = agreements[least]
    return result


def _gated(bundle, int8: Int8, cand: Candidate, models: dict[str, onnx.ModelProto],
           model_outputs: Sequence[str]) -> dict:
    """`gate` on the held-out samples; a refusal of a mixed-precision candidate says how many ops it kept float."""
    try:
        return gate(bundle, int8.held_out, model_outputs)
    except ValueError as e:
        found = int8.mixed_of(cand, models)
        if found is None:
            raise
        raise ValueError(f"{e}, with {len(found['float_ops'])} of {found['ops']} ops kept float") from e


def _mixed_entry(mixed: dict) -> dict:
    """A mixed-precision candidate in the plan's record: how many of its ops stayed float, and which."""
    return {"float_ops": len(mixed["float_ops"]), "ops": mixed["ops"], "names": list(mixed["float_ops"])}


def held_out_split(samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """The calibration samples an int8 candidate is quantized on, and the quarter held out for its
    accuracy gate (at least one); a single sample is both (the record says no sample was held out)."""
    if len(samples) < 2:
        return samples, samples
    held = max(1, len(samples) // 4)
    return samples[:-held], samples[-held:]


def _samples_digest(samples: list[dict], method: str, percentile: float) -> str:
    # int8 candidates are searched for mixed precision, with float inputs and outputs (an older entry
    # measured full int8 only)
    h = hashlib.sha256(json.dumps([method, percentile, GATE_COSINE, GATE_TOP1, "mixed, float i/o"]).encode())
    for sample in samples:
        for name in sorted(sample):
            h.update(name.encode())
            h.update(np.ascontiguousarray(sample[name]).tobytes())
    return h.hexdigest()


def _quantizes(cand: Candidate) -> bool:
    return cand.name != PLANNED and any(backends.backend(s.backend).quantizes for s in cand.segments)


def _time(runnable: dict[str, tuple[Candidate, object]], sample: dict, timer: Timer,
          work: Path, measure: Callable[..., list[float]] | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """Median milliseconds of one inference of each candidate: `ROUNDS` measurements of each, in turn,
    each in a fresh process that loads the candidate's bundle alone (as on a device: no other runtime's
    threads spinning on the cores) and runs it `RUNS` times after `WARMUP`; the median of them all.
    A candidate whose timing run fails is left out, with why. `measure` (bundle, feeds, warmup=, runs=)
    times one measurement: `measure_alone` here, `boards.measure` on a board."""
    measure = measure or measure_alone
    for _, bundle in runnable.values():
        bundle.close()
    feeds = work / "feeds.npz"
    np.savez(feeds, **{t.name: sample[t.name] for _, b in runnable.values() for t in b.inputs})
    laps: dict[str, list[float]] = {n: [] for n in runnable}
    failed: dict[str, str] = {}
    for _ in range(ROUNDS):
        for name, (_, bundle) in runnable.items():
            if name in failed:
                continue
            try:
                laps[name].append(timer(name, lambda b=bundle: statistics.median(
                    measure(b.bundle, feeds, warmup=WARMUP, runs=RUNS))))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed[name] = _short(e)
    return {n: round(statistics.median(v), 4) for n, v in laps.items() if n not in failed}, failed


_CHILD = """
import json, sys, time
import numpy as np
from edgesdk.runtime import BundleModel
model = BundleModel(sys.argv[1], log=lambda s: None)
feeds = dict(np.load(sys.argv[2]))
feeds = {t.name: feeds[t.name] for t in model.inputs}
laps = []
for k in range(int(sys.argv[3]) + int(sys.argv[4])):
    t0 = time.perf_counter()
    model.run(feeds)
    if k >= int(sys.argv[3]):
        laps.append((time.perf_counter() - t0) * 1e3)
print(json.dumps(laps))
"""


def measure_alone(bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]:
    """One measurement of a bundle in a child process of its own: milliseconds per inference of `runs`
    inferences after `warmup`, on the inputs in `feeds` (.npz)."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(bundle), str(feeds), str(warmup), str(runs)],
                          capture_output=True, text=True, env=_child_env(), timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the timing run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_env() -> dict[str, str]:
    """A candidate's child process: this one's environment (the threads it set for the runners,
    TVM_NUM_THREADS and EDGESDK_NUM_THREADS), with edgesdk importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    return env


def _reference(model: onnx.ModelProto, samples: list[dict], plan: Plan) -> list[dict]:
    """Every tensor a CPU segment reads or writes, from onnxruntime on the float model."""
    from ..backends import onnxruntime as ort_backend

    names = sorted({t for s in plan.segments if s.device == HOST for t in (*s.inputs, *s.outputs)} - set(samples[0]))
    # one session for every sample: a session holds the model's weights once more
    return [{**sample, **ref} for sample, ref in zip(samples, ort_backend.run_many(model, samples, names))]


def _extract(model: onnx.ModelProto, seg: PlanSegment) -> onnx.ModelProto:
    index = {irm.node_name(n, i): i for i, n in enumerate(model.graph.node)}
    part = irm.extract_segment(model, [index[n] for n in seg.nodes], list(seg.inputs), list(seg.outputs))
    for node in part.graph.node:
        irm.set_meta(node, irm.DEVICE_KEY, HOST)
    return part


def _key(cand: Candidate, models: dict[str, onnx.ModelProto], tuning_db: Path, host: str, threads: int,
         samples: str = "") -> str:
    """What a candidate's time depends on: its segments' graphs and backends, the tuning records a
    backend that tunes compiles with, the host CPU and the threads, the versions of edgesdk and of
    its backends' distributions; an int8 candidate's also on the calibration samples and method
    (`samples`, their digest)."""
    h = hashlib.sha256()
    for s in cand.segments:
        irm.feed_hash(h, models[s.id])
    tunes = any(backends.backend(s.backend).tunes for s in cand.segments)
    records = tree_sha256(tuning_db, exclude=(backends.KERNEL_TIMES,)) if tunes and tuning_db.is_dir() else ""
    h.update(json.dumps([cand.name, [(s.id, s.backend, s.inputs, s.outputs) for s in cand.segments], records, host,
                         threads, _versions(cand)] + ([samples] if samples else [])).encode())
    return h.hexdigest()


def _versions(cand: Candidate) -> dict[str, str]:
    """edgesdk's version, its backends' revisions, and those of the distributions that compile and run
    the candidate's segments: another compiler or runtime is another candidate, measured anew."""
    from importlib import metadata

    from .. import __version__

    out = {"edgesdk": __version__}
    for b in sorted({s.backend for s in cand.segments}):
        if backends.backend(b).revision:
            out[f"{b} revision"] = str(backends.backend(b).revision)
    for dist in sorted({d for s in cand.segments for d in backends.backend(s.backend).runtime_dists}):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def _replan(plan: Plan, chosen: dict[tuple[int, int], tuple[Candidate, float | None]]) -> Plan:
    """The plan with each span's segments the chosen candidate's. A span of one segment predicts its
    measured time; a cut into several keeps its segments' predictions (they were timed together). The plan's
    predicted latency moves by each span's measured time less what the cost model predicted for it; a
    plan of CPU spans alone, all measured, predicts their sum."""
    segments: list[PlanSegment] = []
    removed: set[str] = set()
    delta = 0.0
    starts = {span[0]: (span, c) for span, c in chosen.items()}
    i = 0
    while i < len(plan.segments):
        if i not in starts:
            segments.append(plan.segments[i])
            i += 1
            continue
        (a, b), (cand, ms) = starts[i]
        old = plan.segments[a:b]
        new = list(cand.segments)
        if ms is not None:
            delta += ms - _span_ms(plan, old)
            if len(new) == 1:  # measured as a whole: the segment's own time
                new = [replace(new[0], predicted_ms=ms)]
        removed |= {s.id for s in old} - {s.id for s in new}
        segments.extend(new)
        i = b
    stages = tuple(kept for stage in plan.pipeline_stages if (kept := tuple(sid for sid in stage if sid not in removed)))
    steps = tuple(step for step in plan.parallel_steps if not set(step) & removed)
    predicted = {**plan.predicted, **{k: round(plan.predicted[k] + delta, 4)
                                      for k in ("latency_ms", "sequential_ms") if k in plan.predicted}}
    measured = [ms for _, ms in chosen.values()]
    if all(s.device == HOST for s in plan.segments) and measured and None not in measured:
        # the whole plan is CPU spans, each measured: one inference is their sum, nothing simulated
        predicted.update({k: round(sum(measured), 4) for k in ("latency_ms", "sequential_ms")})
    return replace(plan, segments=tuple(segments), pipeline_stages=stages, parallel_steps=steps, predicted=predicted)


def _span_ms(plan: Plan, segs: Sequence[PlanSegment]) -> float:
    """What the cost model predicted for a span: its segments in turn, a parallel step's groups at once."""
    step_of = {sid: k for k, step in enumerate(plan.parallel_steps) for sid in step}
    total, steps = 0.0, {}
    for s in segs:
        if s.id in step_of:
            steps[step_of[s.id]] = max(steps.get(step_of[s.id], 0.0), s.predicted_ms)
        else:
            total += s.predicted_ms
    return total + sum(steps.values())


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:300]


def copy_file(src: Path, dest: Path) -> None:
    """A hard link where the file system allows one (segment models can be large), else a copy; a
    model's external data (`irm.save`'s `.data` beside it) with it."""
    data = src.with_name(src.name + ".data")
    for a, b in ((src, dest), *([(data, dest.with_name(dest.name + ".data"))] if data.is_file() else [])):
        try:
            os.link(a, b)
        except OSError:
            shutil.copyfile(a, b)
