"""Each CPU span of a plan on the fastest backend measured, as TensorRT times its tactics and Collage
chooses among backends.

A span is a run of consecutive plan segments on the host (the groups of its parallel steps included;
in a throughput plan, inside one pipeline stage): the schedule cut it by backend (TVM, onnxruntime for the ops TVM lacks) by the cost model, which
costs every CPU backend alike. Its candidates are the plan's own cut, and the whole span as one segment
on each CPU backend that lowers every node of it (`Backend.lowering`; TVM with the tuning database's
records, onnxruntime, LiteRT/XNNPACK fp32: the registry's `cpu_candidates`) among those `--cpu-backends`
allows. Per span, `select` reads: candidates, check, time, choose, re-plan. Each candidate is made a
bundle of its own (`build`: its segments compiled by their backends, its parallel steps) and run by the
runtime's executor, as a device runs it (a runner, `edgesdk.timing`); checked against onnxruntime on the float model (`TOLERANCE`
of each output's scale; a candidate that fails is skipped, with why; a quantized TFLite model whose whole graph is
one span is checked and gated against LiteRT on its own file instead, which is a candidate too, `OWN`); and timed: `ROUNDS` measurements
of each, the candidates in turn, each measurement a fresh process that loads the candidate alone
(`timing.FreshProcess`: no other runtime's threads spin on the cores, as on a device) and times `RUNS`
inferences after `WARMUP`: the median of them all decides.

Timing happens on the build host when it runs the target's CPU code (the same architecture, no
instruction the host lacks); otherwise (an aarch64 target built on an x86-64 host) on a board over TVM
RPC where boards are given (`boards.BoardRunner`: the same candidates, checks and rounds, each
measurement a session of its own on a board). Without boards nothing is timed and each span's backend is chosen by
policy (`by_policy`): the schedule's cut where the tuning database holds
tuned TVM records for all of its functions, else the whole span on LiteRT/XNNPACK (what ARM users run)
where it lowers every node and agrees with onnxruntime on this host, else the schedule's cut; the record
says why, with `measured_on: null`.

A measurement is kept in a timing cache (`timing.TimingCache`, beside the tuning database, keyed (`_key`) by the segment's
bytes, the backend, the database's records it compiles with, the host CPU and the threads), so a
rebuild replays it: the same choice, the same bundle bytes. It replays times, never correctness: the
fastest candidate is built and checked again (an int8 one gated again) on every build, and one that
fails is dropped from the cache for the next fastest, which is checked in turn. Nor does it replay a choice
unseen: the winner, built to be checked, is timed once more (one round); on a quiet host, a time now slower
than the runner-up's cached one beyond `CONFIRM_MARGIN` means the cache no longer says which is faster here,
and every candidate of the span is timed again.

The chosen candidate's segments replace the span's in a new plan; a segment's predicted time becomes
its measured time, and the plan's predicted latency moves by the difference.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .. import backends
from ..backends.tflite import own as own_tflite
from ..config import HOST
from ..ir import model as irm
from ..ir.digest import file_sha256, tree_sha256
from ..ir.memory import give_back
from ..ir.numeric import largest_difference, nudged
from ..ir.grids import grids as quantized_grids
from ..timing import RUNS, WARMUP, FreshProcess, Handle, InProcess, Runner, TimingCache, failure
from ..timing.load import checking, others_share
from .plan import Plan, PlanSegment

GATE_COSINE = 0.99  # an int8 candidate's least cosine similarity to fp32, per output, on held-out samples
GATE_TOP1 = 0.9  # and its least agreement of the arg max of a class-score output's last axis
PLANNED = "planned"  # the candidate that keeps the schedule's own cut
# a quantized TFLite model's own file as given, on LiteRT (backends/tflite/own.py): a candidate where one CPU span
# holds the whole imported graph and `OWN_OF` is allowed; that span's candidates are then checked and gated
# against it, not against onnxruntime on the QDQ graph the import made of it (another int8 arithmetic)
OWN = "litert-own"
OWN_OF = "litert"
ROUNDS = 3  # each candidate measured this many times, in turn, each time in a process of its own
# A replayed winner is timed once more (one round) on every rebuild: slower now than the runner-up's cached time by
# more than this (or than their cached rounds spread, where that is more), on a quiet host, the cache no longer
# says which is faster here (the host's clock, memory or other work changed) and the span's candidates are all
# timed again. Only a lost lead refutes: a winner merely slower or faster than its cached time keeps its place.
CONFIRM_MARGIN = 0.25
# Where the fastest leads the next by no more than their rounds' spread, the two are timed this many rounds more,
# in turn, and decided on all their rounds: on 2-vCPU hosts a candidate's rounds spread 12-35 % with nothing else
# running, and three rounds left many close choices to chance.
SETTLE_ROUNDS = 3
TOLERANCE = 1e-3  # of each output's scale (its largest magnitude): fp32 kernels that sum in another order
# Some models move further than TOLERANCE by rounding alone (LeViT-128S with random weights: one float32 rounding step
# in its input moves its logits by 2-4 % of their scale, and every candidate, each compiled its own way, was refused).
# Where a candidate misses TOLERANCE by less than FLOOR_PROBE, that floor is measured on the span (`_rounding_floor`)
# and candidates are checked within FLOOR_FACTOR times it: a wrong kernel is off by far more.
FLOOR_PROBE = 0.1
FLOOR_FACTOR = 3.0
# the check's rules, in the timing cache's key: a candidate a former rule refused (cached as skipped) is tried again
CHECK_RULES = 6
CHECK_SAMPLES = 2
# a candidate with more weights than this is checked in a process of its own (`timing.Apart`), as it is timed: a
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
    grids: dict[str, tuple[float, float]] = field(default_factory=dict)  # a quantized model's own (legalization/quantized.py)

    def quantize(self, s: PlanSegment, model: onnx.ModelProto, out_dir: Path) -> dict:
        """`s` quantized by its backend into `out_dir`: the quantizer's record."""
        key = _mixed_key(s, model)
        known = self.mixed.get(key)
        record = backends.backend(s.backend).quantize(backends.QuantizeJob(
            segment=s, model=model, samples=[{k: v[k] for k in (*s.inputs, *s.outputs)} for v in self.calibration],
            out_dir=out_dir, method=self.method, percentile=self.percentile, log=self.log,
            target=backends.AccuracyTarget(GATE_COSINE, GATE_TOP1, tuple(o for o in s.outputs if o in self.model_outputs)),
            keep_float=tuple(known["float_ops"]) if known else None, grids=self.grids))
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


def candidates(plan: Plan, span: tuple[int, int], model: onnx.ModelProto, allowed: Sequence[str],
               own: Path | None = None) -> tuple[list[Candidate], dict[str, str]]:
    """The plan's cut and each allowed backend's whole span; the backends left out, and why. With `own` (a
    quantized TFLite model's own file) and `OWN_OF` allowed, the file as given (`OWN`) where the span is the
    whole model."""
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
        if pinned and backends.backend(name).precision != "fp32":
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
    if own is not None and OWN_OF in allowed:
        why = _not_whole(model, nodes, inputs, outputs) or own_tflite.mismatch(own, model)
        if why is not None:
            skipped[OWN] = why
        else:
            found.append(Candidate(OWN, (PlanSegment(segs[0].id, HOST, OWN, f"segments/{segs[0].id}.onnx", tuple(nodes),
                                                     inputs, outputs, sum(s.flops for s in segs),
                                                     sum(s.param_bytes for s in segs),
                                                     round(sum(s.predicted_ms for s in segs), 4)),)))
    return found, skipped


def _not_whole(model: onnx.ModelProto, nodes: Sequence[str], inputs: Sequence[str], outputs: Sequence[str]) -> str | None:
    """Why a span is not the whole model (its every node, its inputs and outputs); None where it is."""
    inits = {i.name for i in model.graph.initializer}
    if len(nodes) != len(model.graph.node):
        return f"the span holds {len(nodes)} of the model's {len(model.graph.node)} nodes, not the whole model"
    if set(inputs) != {i.name for i in model.graph.input if i.name not in inits} or \
            set(outputs) != {o.name for o in model.graph.output}:
        return "the span's inputs and outputs are not the model's"
    return None


def select(plan: Plan, model: onnx.ModelProto, segment_models: Callable[[PlanSegment], onnx.ModelProto], target,
           samples: list[dict], *, allowed: Sequence[str], tuning_db: Path, cache: TimingCache,
           measurable: str | None, host: str, log: Callable[[str], None], timer: Timer = measured,
           precision: str = "fp32", calib_method: str = "minmax", calib_percentile: float = 99.99,
           int8_dir: Path | None = None, boards: backends.Boards | None = None, board: dict | None = None,
           only: Sequence[str] | None = None, runner: Runner | None = None, own: Path | None = None) -> Selected:
    """The plan with every CPU span on its fastest candidate. `measurable` is None where this host can
    time the target's CPU code, else why not (then the candidates are chosen by policy, `by_policy`,
    and `model` and `samples` are needed only where the policy's backend is allowed); `samples` are inputs
    of the whole model; `host` names this host's CPU (and keys the timing cache). With `precision` "int8",
    "bf16", "fp16" or "auto" (all), the allowed backends' variants in those precisions that the target's CPU has
    (`reduced_precisions`, `backends.variant`) are candidates too, gated on the held-out share of `samples`
    (`held_out_split`) against fp32 and an int8 one quantized on the calibration share first; each int8
    one chosen is quantized again, as measured, into `int8_dir` (its `segments/`) for the package stage.

    Where this host cannot time the target's CPU code and `boards` (`--rpc-tracker`, `--rpc-key`) are
    given, the candidates are checked and timed on a board (`boards.BoardRunner`) instead of chosen by
    policy; `host` then names the board's CPU (`board`: what the board said of itself, asked if not given).
    Else `runner` times them (a fresh process per measurement, `timing.FreshProcess`, unless given).
    With `only` (`--low-memory`), a candidate with a segment another backend compiles is left out, and
    a span left with one candidate other than the plan's cut takes it unbuilt and untimed.

    `own`: a quantized TFLite model's own file (the import kept it). Where one CPU span holds the whole model,
    the file as given is a candidate (`OWN`), and every candidate of the span is checked against it, not against
    onnxruntime on the QDQ graph, and gated against it on the held-out samples (`_Own`): another int8 arithmetic
    that rounds near ties otherwise (an int8 softmax's) is refused here, where the next candidate can be chosen,
    not by the package stage's gate after the choice."""
    reduced, lacking = reduced_precisions(precision, target)
    allowed = [*allowed, *(v for p in reduced for b in allowed if (v := backends.variant(b, p)) is not None)]
    record: dict = {"candidates": list(allowed), "measured_on": host, "spans": []}
    if precision != "fp32":
        record["precision"] = precision
    this_host = _this_hosts_cpu(target)
    if this_host is not None:
        record["target_cpu"] = this_host
        log(f"tune: the target's CPU is this host's ({this_host['mcpu']}): "
            + (", ".join(this_host["features"]) or "none of " + ", ".join(SAID_FEATURES)))
    if lacking:
        record["precisions_not_offered"] = lacking
        for p, why in lacking.items():
            log(f"tune: no {p} candidate: {why}")
    found = spans(plan)
    if not found:
        record = {**record, "note": "no CPU segment"}
        return Selected(replace(plan, cpu_selection=record), {}, record)
    int8 = _int8(plan, model, samples, allowed, precision, calib_method, calib_percentile, log, record)
    # the model's own file only where one span holds every node: a part of the model cannot be cut from it
    own = own if (own is not None and OWN_OF in allowed and model is not None and len(found) == 1
                  and sum(len(s.nodes) for s in plan.segments[found[0][0]:found[0][1]]) == len(model.graph.node)) else None
    runner, host, threads = _where_timed(target, measurable, boards, board, runner or FreshProcess(), host, log, record)
    if runner is None:  # this host cannot time the target's CPU code: chosen by policy
        chosen_plan, models, record = by_policy(plan, model, segment_models, target, samples, allowed=allowed,
                                                tuning_db=tuning_db, unmeasured=measurable, log=log, int8=int8,
                                                record=record, own=own)
        return Selected(chosen_plan, models, record, _quantize_chosen(chosen_plan, models, int8, int8_dir, log))
    values = _reference(model, samples[:CHECK_SAMPLES], plan)
    reference = _Own.of(own, model, values, samples, log) if own is not None else None
    if reference is not None:
        values = reference.values
        record["reference"] = reference.describe()
    for var in ("TVM_NUM_THREADS", "EDGESDK_NUM_THREADS"):  # as the bundle's executor sizes the runners
        os.environ.setdefault(var, str(threads))

    chosen: dict[tuple[int, int], tuple[Candidate, float | None]] = {}
    models: dict[str, onnx.ModelProto] = {}
    with tempfile.TemporaryDirectory(prefix="edgesdk-select-") as tmp:
        bench = _Bench(model, segment_models, target, values, int8, plan.outputs, Path(tmp), tuning_db, cache, host,
                       threads, log, timer, runner, reference)
        for span in found:
            # candidates: the plan's cut, and the whole span on each allowed backend that lowers every node of it
            cands, skipped = candidates(plan, span, model, allowed, own if reference is not None else None)
            if only is not None:
                cands = _low_memory(cands, skipped, only)
            if len(cands) == 1:  # nothing to choose between: no build, no timing
                entry, cut = _only_candidate(cands[0], skipped, model, log)
                record["spans"].append(entry)
                if cands[0].name != PLANNED:  # what --low-memory left, taken unmeasured
                    chosen[span] = cands[0], None
                    models.update(cut)
                continue
            entry, winner, ms, cut = _measured(cands, skipped, bench)
            record["spans"].append(entry)
            chosen[span] = winner, ms
            models.update(cut)
    # re-plan: each span's segments the chosen candidate's, their predictions its measured time
    new = replace(_replan(plan, chosen), cpu_selection=record)
    return Selected(new, models, record, _quantize_chosen(new, models, int8, int8_dir, log))


def _int8(plan: Plan, model: onnx.ModelProto | None, samples: list[dict], allowed: Sequence[str], precision: str,
          calib_method: str, calib_percentile: float, log: Callable[[str], None], record: dict) -> Int8 | None:
    """How reduced-precision candidates (`--cpu-precision int8`, `bf16`, `fp16`, `auto`) are gated against fp32 and an
    int8 one quantized, where one is allowed; the gate's thresholds and samples added to `record`."""
    reduced = {b for p in backends.REDUCED for b in backends.cpu_candidates(p)}
    if precision == "fp32" or model is None or not set(allowed) & reduced:
        return None
    calib, held = held_out_split(samples)
    int8 = Int8(_reference(model, calib, plan), _reference(model, held, plan), calib_method, calib_percentile,
                _samples_digest(samples, calib_method, calib_percentile), tuple(plan.outputs), log,
                grids=quantized_grids(model))
    record["gate"] = {"cosine": GATE_COSINE, "top1": GATE_TOP1, "calibration_samples": len(calib),
                      "held_out_samples": len(held) if held is not calib else 0}
    return int8


# what a target CPU needs for a reduced precision's candidates (LLVM's feature names): bfloat16 arithmetic in
# AVX-512 (Cooper Lake, Zen 4 and later) or in AMX's tiles (Sapphire Rapids and later); float16 arithmetic in
# AVX-512 (Sapphire Rapids and later); int8 runs everywhere (VNNI makes it faster, and the timing says by how much)
PRECISION_FEATURES = {"bf16": ("avx512bf16", "amx-bf16"), "fp16": ("avx512fp16",)}


# what a build for this host's CPU says it has: the vector and matrix extensions the CPU backends' kernels and
# the reduced precisions use
SAID_FEATURES = ("avx2", "avx512f", "avx512vnni", "avxvnni", "avx512bf16", "amx-bf16", "amx-int8", "avx512fp16")


def _this_hosts_cpu(target) -> dict | None:
    """Where the target's CPU is this host's (`mcpu: native`): its name and the features of SAID_FEATURES it has."""
    from ..backends.tvm import host_cpu, target_arch, target_features

    codegen = target.host.codegen
    if codegen.get("mcpu") != "native" or target_arch(codegen) != "x86_64":
        return None
    features = target_features(codegen)
    return {"mcpu": host_cpu()[0], "features": [f for f in SAID_FEATURES if f in features]}


def reduced_precisions(precision: str, target) -> tuple[tuple[str, ...], dict[str, str]]:
    """The reduced precisions `precision` (`--cpu-precision`: fp32, bf16, fp16, int8, auto for all) asks for that the
    target's CPU computes in, and why each other one it asks for is not offered."""
    from ..backends.tvm import target_arch, target_features

    wanted = {"fp32": (), "auto": backends.REDUCED}.get(precision, (precision,))
    kept, lacking = [], {}
    for p in wanted:
        needs = PRECISION_FEATURES.get(p)
        if needs is None:
            kept.append(p)
            continue
        codegen = target.host.codegen
        if target_arch(codegen) != "x86_64":
            lacking[p] = f"{p} candidates are offered on x86-64 CPUs with {' or '.join(needs)}"
        elif not set(needs) & target_features(codegen):
            has = f"neither {' nor '.join(needs)}" if len(needs) > 1 else f"no {needs[0]}"
            lacking[p] = (f"the target's CPU ({codegen.get('mcpu', 'generic')}) has {has}; "
                          "a target with mcpu: native builds for this host's CPU")
        else:
            kept.append(p)
    return tuple(kept), lacking


def _where_timed(target, measurable: str | None, boards: backends.Boards | None, board: dict | None, runner: Runner,
                 host: str, log: Callable[[str], None], record: dict) -> tuple[Runner | None, str, int]:
    """What times the candidates (None: nothing can, they are chosen by policy), the CPU it names for the
    timing cache, and the threads they run on: this host's, or with `boards` a board's where this
    host cannot run the target's CPU code."""
    threads = min(target.host.cores, os.cpu_count() or 1)
    if measurable is None:
        return runner, host, threads
    if boards is None:
        return None, host, threads
    from . import boards as on_boards

    board = board or on_boards.describe(boards)
    host = on_boards.name(board, boards)
    record["measured_on"] = f"{host} via {boards.host}:{boards.port}"
    log(f"tune: CPU candidates are timed on {host}")
    return on_boards.BoardRunner(boards), host, min(target.host.cores, int(board["cores"]))


def _low_memory(cands: list[Candidate], skipped: dict[str, str], only: Sequence[str]) -> list[Candidate]:
    """`--low-memory`: the candidates whose segments `only`'s backends compile (`skipped` says why the others
    are left out); none left, the plan's cut."""
    if all(s.backend in only for c in cands for s in c.segments):
        return cands
    kept = [c for c in cands if all(s.backend in only for s in c.segments)]
    skipped.update({c.name: f"--low-memory: compiled by {', '.join(sorted({s.backend for s in c.segments}))}"
                    for c in cands if c not in kept})
    return kept or cands[:1]


def _only_candidate(cand: Candidate, skipped: dict[str, str], model: onnx.ModelProto,
                    log: Callable[[str], None]) -> tuple[dict, dict[str, onnx.ModelProto]]:
    """The record of a span with one candidate, taken unbuilt and untimed (the plan's cut, or what
    `--low-memory` left), and the segment models it cuts anew."""
    if cand.name == PLANNED:
        return _unmeasured(cand, skipped, "the only candidate"), {}
    entry = _unmeasured(cand, skipped, "the only candidate (--low-memory)")
    log(f"tune: span of {entry['nodes']} nodes: {cand.name}, the only candidate (--low-memory)")
    return entry, {s.id: _extract(model, s) for s in cand.segments}


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
              record: dict | None = None, own: Path | None = None) -> tuple[Plan, dict[str, onnx.ModelProto], dict]:
    """The plan with each CPU span's backend chosen by policy, where this host cannot time the target's
    CPU code (`unmeasured` says why: an aarch64 target built on an x86-64 host). Per span:

    1. the schedule's cut where its TVM kernels are tuned: the database holds tuned records for every
       function of its TVM segments (for a foreign CPU, only a search measured on the boards over RPC
       writes them: tuning the user paid for);
    2. else the whole span on LiteRT/XNNPACK (`backends.policy_fallback()`, what ARM users run), where it
       lowers every node and its output agrees with onnxruntime on the float model (`check`, on this host: TFLite's fp32
       kernels compute the same function on every CPU, within TOLERANCE);
    3. else the schedule's cut (TVM's untuned kernels), with why.

    With `int8` (`--cpu-precision int8`, `litert-int8` allowed), step 2 tries LiteRT's int8 first, where
    it passes the accuracy gate on the held-out samples (`gate`, on this host: the int8 kernels'
    arithmetic is specified to the bit), and falls back to fp32 LiteRT with why.

    Before all of these, a span that holds the whole of a quantized TFLite model (`own`, its file) ships the file
    as given (`OWN`): what the model computes, the accuracy gate's reference, on LiteRT.

    `--cpu-backends` still restricts: without `litert` in `allowed`, every span keeps the schedule's
    cut. `model` and `samples` are needed only where `litert` is allowed. Nothing is timed: the segments
    keep the cost model's predictions, and the record says `measured_on: null`. Returns the plan, the
    segments it cut anew, and the record (`record`'s keys kept)."""
    record = {**(record or {}), "candidates": list(allowed), "measured_on": None,
              "note": f"not measured ({unmeasured}): chosen by policy", "spans": []}
    chosen: dict[tuple[int, int], tuple[Candidate, float | None]] = {}
    models: dict[str, onnx.ModelProto] = {}
    values: list[dict] = []
    policy = backends.policy_fallback()
    with tempfile.TemporaryDirectory(prefix="edgesdk-policy-") as tmp:
        for span in spans(plan):
            segs = plan.segments[span[0]:span[1]]
            ids = [s.id for s in segs]
            label = ids[0] if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
            planned = Candidate(PLANNED, segs, tuple(st for st in plan.parallel_steps if set(st) <= set(ids)))
            considered: dict[str, dict] = {PLANNED: {"policy": "the schedule's cut"}}
            winner, why = planned, "the schedule's cut"
            litert, span_check = None, None
            as_given = None
            if own is not None:
                cands, skipped = candidates(plan, span, model, [OWN_OF], own)
                as_given = next((c for c in cands if c.name == OWN), None)
                considered[OWN] = ({"policy": "the model's own int8 TFLite file, as given"} if as_given is not None
                                   else {"skipped": skipped[OWN]})
            if as_given is not None:
                winner, why = as_given, "the imported TFLite file as given (the model's own int8 arithmetic)"
                models.update({s.id: _extract(model, s) for s in as_given.segments})
            elif policy is not None and policy in allowed:
                cands, skipped = candidates(plan, span, model, [policy])
                litert = next((c for c in cands if c.name == policy), None)
                if litert is None:
                    considered[policy] = {"skipped": skipped[policy]}
                    why += f" ({policy}: {skipped[policy]})"
            if litert is not None:  # the schedule's cut tuned for this target, or LiteRT where it agrees
                untuned = _untuned(planned, segment_models, target, tuning_db)
                if untuned is None:
                    considered[PLANNED] = {"policy": "TVM's kernels tuned"}
                    considered[policy] = {"policy": "not built: the schedule's cut is tuned"}
                    why = "TVM's kernels of the schedule's cut are tuned"
                else:
                    considered[PLANNED] = {"policy": f"untuned: {untuned}"}
                    values = values or _reference(model, samples[:CHECK_SAMPLES], plan)
                    variant = backends.variant(policy, "int8")
                    tried = ([variant] if int8 is not None and variant is not None and variant in allowed
                             and not kept_float(plan, [n for s in segs for n in s.nodes]) else [])
                    span_check = SpanCheck(label, log)
                    found, told, cut = _first_agreeing(litert, [*tried, policy], policy, model, target,
                                                       Path(tmp) / label, tuning_db, int8, values, plan.outputs,
                                                       considered, span_check)
                    if found is None:
                        why += told
                    else:
                        winner, why = found, told
                        models.update(cut)
            entry = {"segments": ids, "nodes": sum(len(s.nodes) for s in segs), "candidates": considered,
                     "chosen": winner.name, "why": f"policy: {why}; not measured: {unmeasured}"}
            if span_check is not None and span_check.widened:
                entry["check_tolerance"] = span_check.widened
            record["spans"].append(entry)
            log(f"tune: {label} ({entry['nodes']} nodes): {winner.name}, policy: {why}")
            chosen[span] = winner, None
    return replace(_replan(plan, chosen), cpu_selection=record), models, record


def _first_agreeing(whole: Candidate, names: Sequence[str], policy: str, model: onnx.ModelProto, target, work: Path,
                    tuning_db: Path, int8: Int8 | None, values: list[dict], model_outputs: Sequence[str],
                    considered: dict[str, dict], span_check: SpanCheck
                    ) -> tuple[Candidate | None, str, dict[str, onnx.ModelProto]]:
    """The policy's whole-span candidate on each backend of `names` in turn (its int8 variant first): the
    first that builds and agrees with onnxruntime (`span_check`, as a measured choice checks; an int8 one: passes
    the accuracy gate), why, and the segment models it cuts anew; None and why each failed where none does.
    `considered` records each one tried."""
    failed = ""
    for name in names:
        cand = replace(whole, name=name, segments=tuple(replace(s, backend=name) for s in whole.segments))
        cut = {s.id: _extract(model, s) for s in cand.segments}
        try:
            with closing(open_candidate(cand, cut, target, Path(f"{work}-{name}"), tuning_db,
                                        int8 if name != policy else None)) as handle:
                gated = _gated(handle, int8, cand, cut, model_outputs) if name != policy else None
                if gated is None:
                    span_check(handle, values, cut[cand.segments[0].id])
        except Exception as e:  # noqa: BLE001 -- one that does not build, run or agree is never chosen
            considered[name] = {"skipped": failure(e)}
            failed += f" ({name}: {failure(e)})"
            continue
        if gated is not None:
            found = int8.mixed_of(cand, cut)
            considered[name] = {"policy": "lowers every node; passes the accuracy gate", "gate": gated,
                                **({"mixed": _mixed_entry(found)} if found else {})}
            return cand, "LiteRT int8 lowers every node and passes the accuracy gate", cut
        considered[name] = {"policy": "lowers every node; agrees with onnxruntime"}
        return cand, "LiteRT lowers every node" + failed, cut
    return None, failed, {}


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
            why = f"could not tell: {failure(e)}"
        if why is not None:
            return why
    return None


@dataclass(frozen=True)
class _Bench:
    """What every span's candidates are built, checked and timed with."""

    model: onnx.ModelProto
    segment_models: Callable[[PlanSegment], onnx.ModelProto]
    target: Any
    values: list[dict]  # the reference values the checks compare with (CHECK_SAMPLES samples)
    int8: Int8 | None
    model_outputs: Sequence[str]
    work: Path
    tuning_db: Path
    cache: TimingCache
    host: str
    threads: int
    log: Callable[[str], None]
    timer: Timer
    runner: Runner
    own: "_Own | None" = None  # the whole model's own TFLite file: what its one span is checked and gated against


@dataclass
class _Trial:
    """One span's candidates on their way from check to choice: each one's segment models and timing cache
    key, the times measured or replayed, the int8 ones' gate figures, and the span's record so far."""

    cands: list[Candidate]
    entry: dict
    label: str
    cut: dict[str, dict[str, onnx.ModelProto]] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    spreads: dict[str, float] = field(default_factory=dict)  # how far its rounds' medians were apart, of its time
    rounds: dict[str, int] = field(default_factory=dict)  # a candidate timed more than ROUNDS rounds: how many
    span_check: SpanCheck | None = None  # made by its first float candidate (`_check_span`)
    gates: dict[str, dict] = field(default_factory=dict)
    replayed: list[str] = field(default_factory=list)
    checked: dict[str, tuple[Candidate, Checked]] = field(default_factory=dict)  # built and checked by this build

    def skip(self, name: str, why: str, bench: _Bench, note: str = "") -> None:
        """A candidate never chosen: why, in the record, the log and the timing cache."""
        self.entry["candidates"][name] = {"skipped": why}
        bench.cache.put(self.keys[name], {"skipped": why})
        bench.log(f"tune: {self.label}: {name} skipped: {why}{note}")


class _Stale(Exception):
    """A replayed winner timed again on a quiet host and found behind the runner-up's cached time beyond
    `CONFIRM_MARGIN` (or unable to be timed): what was measured, for the log and the span's record."""

    def __init__(self, figures: dict):
        super().__init__(figures)
        self.figures = figures


def _measured(cands: list[Candidate], skipped: dict[str, str], bench: _Bench
              ) -> tuple[dict, Candidate, float | None, dict[str, onnx.ModelProto]]:
    """One span's choice: each candidate built and checked against onnxruntime (int8, bf16: the accuracy gate), or
    its time replayed from the timing cache; the checked ones timed, `ROUNDS` measurements each, in turn; the
    fastest chosen, checked by this build (`_choose`). Where a replayed winner timed again has lost its lead,
    every candidate is built and timed again."""
    trial = _build_and_check(cands, skipped, bench)
    _time(trial, bench)
    try:
        return _choose(trial, bench)
    except _Stale as stale:
        figures = stale.figures
    now = (f"failed to time now ({figures['failed']})" if "failed" in figures
           else f"measured {figures['now_ms']:.3f} ms now ({figures['cached_ms']:.3f} ms in the timing cache), slower "
                f"than {figures['runner_up']}'s {figures['runner_up_ms']:.3f} ms beyond {figures['margin']:.0%}")
    bench.log(f"tune: {trial.label}: {figures['candidate']} {now}: the cache no longer says which is faster on this "
              "host, the span's candidates are timed again")
    trial = _build_and_check(cands, skipped, bench, replay=False)
    _time(trial, bench)
    entry, *chosen = _choose(trial, bench)
    entry["replay_refuted"] = figures
    return (entry, *chosen)


def _build_and_check(cands: list[Candidate], skipped: dict[str, str], bench: _Bench, *,
                     replay: bool = True) -> _Trial:
    """Each candidate's time replayed from the timing cache, or it built and checked against onnxruntime
    (an int8 one through the accuracy gate on the held-out samples); one that does not build, run or agree
    is skipped, with why. Times are replayed only where the cache holds every candidate's: where one is
    new, all are timed again, together, since times measured by other builds under other loads do not
    compare (and none where `replay` is false). A checked candidate's runtime is let go before the next is
    built: the candidates' weights are never all held at once."""
    ids = [s.id for s in cands[0].segments]
    trial = _Trial(cands, {"segments": ids, "nodes": sum(len(s.nodes) for s in cands[0].segments),
                           "candidates": {name: {"skipped": why} for name, why in skipped.items()}},
                   ids[0] if len(ids) == 1 else f"{ids[0]}..{ids[-1]}")
    extracted: dict[tuple, onnx.ModelProto] = {}

    def shared(s: PlanSegment) -> onnx.ModelProto:
        """Candidates that cut the same segment share one model (one copy of its weights)."""
        key = (tuple(s.nodes), tuple(s.inputs), tuple(s.outputs))
        if key not in extracted:
            extracted[key] = _extract(bench.model, s)
        return extracted[key]

    int8 = bench.int8
    hits = {}
    for cand in cands:
        cut = trial.cut[cand.name] = {s.id: bench.segment_models(s) if cand.name == PLANNED else shared(s)
                                      for s in cand.segments}
        key = trial.keys[cand.name] = _key(cand, cut, bench.tuning_db, bench.host, bench.threads,
                                           _gate_digest(cand, bench))
        hits[cand.name] = bench.cache.get(key)
    new = [name for name, hit in hits.items() if hit is None]
    timed = [name for name, hit in hits.items() if hit is not None and "skipped" not in hit]
    if not replay:
        hits.update(dict.fromkeys(timed))
    elif new and timed:
        bench.log(f"tune: {trial.label}: {', '.join(new)} not in the timing cache: "
                  f"{', '.join(timed)} timed again with {'it' if len(new) == 1 else 'them'}")
        hits.update(dict.fromkeys(timed))
    for cand in cands:
        cut, key, hit = trial.cut[cand.name], trial.keys[cand.name], hits[cand.name]
        quantized = _reduced(cand)
        if hit is not None:  # measured by an earlier build on this host: replayed, so the bundle is the same bytes
            if "skipped" in hit:
                trial.entry["candidates"][cand.name] = {"skipped": hit["skipped"]}
            else:
                trial.times[cand.name] = hit["ms"]
                trial.spreads[cand.name] = hit.get("spread", 0.0)
                if "rounds" in hit:
                    trial.rounds[cand.name] = hit["rounds"]
                if "gate" in hit:
                    trial.gates[cand.name] = hit["gate"]
                if "mixed" in hit:
                    int8.remember(cand, cut, hit["mixed"])
            trial.replayed.append(cand.name)
            continue
        try:
            with closing(open_candidate(cand, cut, bench.target, bench.work / cand.name, bench.tuning_db,
                                        int8 if quantized else None, bench.runner, source=bench.own and bench.own.path)
                         ) as handle:
                gated = _verify(handle, cand, cut, trial, bench)
                if gated is not None:
                    trial.gates[cand.name] = gated
                trial.checked[cand.name] = cand, Checked(handle.bundle, tuple(handle.inputs))
        except Exception as e:  # a candidate that does not build, run or agree is never chosen
            trial.skip(cand.name, failure(e), bench)
        give_back()  # what its compiler and runtime freed, before the next candidate compiles
    return trial


@dataclass(frozen=True)
class Checked:
    """A candidate bundle built and checked, its runtime let go: what timing it needs."""

    bundle: Path
    inputs: tuple


def _time(trial: _Trial, bench: _Bench) -> None:
    """The checked candidates timed (`_rounds`), their times kept in the timing cache unless other processes
    took the cores meanwhile (`timing.load`). A timing under load is measured again at once, all candidates
    together: the quieter of the two is used, cached only where it was quiet (the span's record says how
    busy the host was, and a later build measures again). One whose timing run fails is skipped, with why."""
    from .boards import BoardRunner

    check = checking() and not isinstance(bench.runner, BoardRunner)  # a board's cores are its own
    laps: dict[str, list[float]] = {}
    with others_share() as load:
        measured, failed, spreads = _rounds(trial.checked, bench.values[0], bench.timer, bench.work, bench.runner,
                                            laps=laps)
    if check and load.busy:
        bench.log(f"tune: {trial.label}: other processes took {load.others:.0%} of the CPU while its candidates "
                  "were timed: timing them again")
        laps_again: dict[str, list[float]] = {}
        with others_share() as again:
            second = _rounds({n: c for n, c in trial.checked.items() if n not in failed}, bench.values[0], bench.timer,
                             bench.work, bench.runner, laps=laps_again)
        trial.entry["timed_twice"] = {"first": load.others, "second": again.others}
        if again.others is not None and again.others < load.others:
            load, laps = again, laps_again
            measured, failed, spreads = second[0], {**failed, **second[1]}, second[2]
    busy = check and load.busy
    if busy:
        trial.entry["host_busy"] = load.others
        bench.log(f"tune: {trial.label}: other processes took {load.others:.0%} of the CPU while its candidates "
                  "were timed: these times are not cached")
    else:
        _settle(trial, bench, laps, measured, failed, spreads, check)
    mixed = {name: found for name, (cand, _) in trial.checked.items() if name in trial.gates and bench.int8 is not None
             and (found := bench.int8.mixed_of(cand, trial.cut[name]))}
    for name, ms in measured.items():
        if len(laps.get(name, ())) > ROUNDS:
            trial.rounds[name] = len(laps[name])
        if not busy:
            bench.cache.put(trial.keys[name], {"ms": ms, "spread": spreads[name],
                                               **({"rounds": trial.rounds[name]} if name in trial.rounds else {}),
                                               **({"gate": trial.gates[name]} if name in trial.gates else {}),
                                               **({"mixed": mixed[name]} if name in mixed else {})})
        trial.times[name] = ms
        trial.spreads[name] = spreads[name]
    for name, why in failed.items():  # built and checked, but its timing run failed: never chosen
        trial.entry["candidates"][name] = {"skipped": why}
        bench.log(f"tune: {trial.label}: {name} skipped: {why}")


def _settle(trial: _Trial, bench: _Bench, laps: dict[str, list[float]], measured: dict[str, float],
            failed: dict[str, str], spreads: dict[str, float], check: bool) -> None:
    """Where the fastest leads the next by no more than their rounds' spread, both timed `SETTLE_ROUNDS` more
    rounds, in turn, and `measured` and `spreads` made those of all their rounds (the span's record says
    `settled`, from `trial.rounds`, which the cache keeps: a replay writes the same record). Rounds taken while
    other processes took the CPU are dropped, and the first rounds decide."""
    order = [c.name for c in trial.cands]
    if len(measured) < 2:
        return
    best = min(measured, key=lambda n: (measured[n], order.index(n)))
    close = _within_noise(best, measured, spreads)
    if close is None:
        return
    pair = {n: trial.checked[n] for n in (best, close["runner_up"])}
    more = {n: list(laps[n]) for n in pair}
    with others_share() as load:
        now, lost, spread_now = _rounds(pair, bench.values[0], bench.timer, bench.work, bench.runner,
                                        rounds=SETTLE_ROUNDS, laps=more)
    if check and load.busy:
        bench.log(f"tune: {trial.label}: {best} and {close['runner_up']} within their rounds' noise, timed again "
                  f"while other processes took {load.others:.0%} of the CPU: those rounds are dropped")
        return
    failed.update(lost)
    for name in lost:
        measured.pop(name, None)
    measured.update(now)
    spreads.update(spread_now)
    laps.update(more)
    bench.log(f"tune: {trial.label}: {best} led {close['runner_up']} by {close['margin']:.1%}, within their rounds' "
              f"spread ({close['noise']:.1%}): both timed {SETTLE_ROUNDS} rounds more: "
              + ", ".join(f"{n} {measured[n]:.3f} ms (spread {spreads[n]:.1%})" for n in pair if n in measured))


def _choose(trial: _Trial, bench: _Bench) -> tuple[dict, Candidate, float | None, dict[str, onnx.ModelProto]]:
    """The fastest candidate this build checked: the span's record, the winner, its measured time, and the
    segment models it cuts anew. The cache replays times, never correctness: the fastest is checked unless
    this build checked it already (`_recheck`), and one that fails (an entry planted, or measured by a build
    whose check has since changed) is dropped from the cache for the next fastest. A replayed winner is timed
    once more (`_confirm`); raises `_Stale` where it has lost its lead."""
    cands, times, gates, entry = trial.cands, trial.times, trial.gates, trial.entry
    order = [c.name for c in cands]
    best = None
    for name in sorted(times, key=lambda n: (times[n], order.index(n))):
        if name in trial.checked:
            best = name
            break
        cand = next(c for c in cands if c.name == name)
        try:
            checked, built = _recheck(cand, trial, bench, bench.work / name)
        except Exception as e:  # noqa: BLE001 -- one that does not build, run or agree is never chosen
            del times[name]
            gates.pop(name, None)
            trial.skip(name, failure(e), bench, " (its time was replayed from the timing cache)")
            give_back()
            continue
        if checked is not None and gates.get(name) != checked:  # the gate's figures as measured now
            gates[name] = checked
            bench.cache.put(trial.keys[name], {**bench.cache.get(trial.keys[name]), "gate": checked})
        _confirm(trial, cand, built, bench)
        best = name
        break
    if best is None:  # nothing could be measured: the plan stays as the cost model made it
        entry["chosen"], entry["why"] = PLANNED, "no candidate could be measured"
        return entry, cands[0], None, {}
    for name, ms in times.items():
        found = (bench.int8.mixed_of(next(c for c in cands if c.name == name), trial.cut[name])
                 if name in gates and bench.int8 is not None else None)
        entry["candidates"][name] = {"ms": ms, **({"spread": trial.spreads[name]} if name in trial.spreads else {}),
                                     **({"gate": gates[name]} if name in gates else {}),
                                     **({"mixed": _mixed_entry(found)} if found else {})}
    others = ", ".join(f"{n} {times[n]:.3f} ms" for n in sorted(times, key=times.get) if n != best)
    entry["chosen"] = best
    entry["why"] = f"fastest measured: {times[best]:.3f} ms" + (f", against {others}" if others else "")
    settled = sorted((n for n in trial.rounds if n in times), key=lambda n: (times[n], order.index(n)))
    if settled:
        entry["settled"] = {"candidates": settled, "rounds": max(trial.rounds[n] for n in settled)}
    close = _within_noise(best, times, trial.spreads)
    if close is not None:
        entry["within_noise"] = close
        entry["why"] += (f"; within the measured noise: {close['margin']:.1%} ahead of {close['runner_up']}, and their "
                         f"rounds spread by up to {close['noise']:.1%}")
    bench.log(f"tune: {trial.label} ({entry['nodes']} nodes): {best}, {entry['why']}"
              + (f" ({', '.join(trial.replayed)} replayed from the timing cache)" if trial.replayed else ""))
    winner = next(c for c in cands if c.name == best)
    return entry, winner, times[best], ({} if best == PLANNED else trial.cut[best])


def _within_noise(best: str, times: dict[str, float], spreads: dict[str, float]) -> dict | None:
    """Where the winner's lead over the next fastest is no more than the noise of their own rounds (the larger
    spread of the two): the runner-up, the margin and the noise; None where the lead exceeds it."""
    rest = sorted((n for n in times if n != best), key=times.get)
    if not rest:
        return None
    runner_up = rest[0]
    margin = times[runner_up] / times[best] - 1.0
    noise = max(spreads.get(best, 0.0), spreads.get(runner_up, 0.0))
    if margin > noise:
        return None
    return {"runner_up": runner_up, "margin": round(margin, 4), "noise": round(noise, 4)}


def _recheck(cand: Candidate, trial: _Trial, bench: _Bench, work: Path) -> tuple[dict | None, Checked]:
    """A candidate whose time was replayed, built and checked as a measured one is: against onnxruntime
    (None), or an int8 one through the accuracy gate on the held-out samples (its figures); and the bundle
    built, to time. Raises where it does not build, run or pass."""
    int8 = bench.int8 if _reduced(cand) else None
    models = trial.cut[cand.name]
    with closing(open_candidate(cand, models, bench.target, work, bench.tuning_db, int8, bench.runner,
                                source=bench.own and bench.own.path)) as handle:
        return _verify(handle, cand, models, trial, bench), Checked(handle.bundle, tuple(handle.inputs))


def _confirm(trial: _Trial, cand: Candidate, built: Checked, bench: _Bench) -> None:
    """A replayed winner timed once more, one round, beside the runner-up's cached time. Raises `_Stale` where, on
    a quiet host, it is now slower than the runner-up beyond `CONFIRM_MARGIN` (or their cached rounds' spread,
    where more), or its timing run fails; on a busy host the replay stands, unjudged. A confirmed replay leaves the
    span's record as the build that measured it wrote it: a rebuild is the same bytes."""
    from .boards import BoardRunner

    name, cached = cand.name, trial.times[cand.name]
    rest = sorted((n for n in trial.times if n != name), key=trial.times.get)
    if not rest:  # chosen over nothing measured: nothing to confirm
        return
    runner_up = rest[0]
    with others_share() as load:
        now, failed, _ = _rounds({name: (cand, built)}, bench.values[0], bench.timer, bench.work, bench.runner,
                                 rounds=1)
    margin = max(CONFIRM_MARGIN, trial.spreads.get(name, 0.0), trial.spreads.get(runner_up, 0.0))
    against = trial.times[runner_up]
    if checking() and not isinstance(bench.runner, BoardRunner) and load.busy:
        bench.log(f"tune: {trial.label}: {name}'s replayed lead not confirmed: other processes took "
                  f"{load.others:.0%} of the CPU while it was timed again")
        return
    if failed or now[name] > against * (1.0 + margin):
        raise _Stale({"candidate": name, "cached_ms": cached, "now_ms": now.get(name), "runner_up": runner_up,
                      "runner_up_ms": against, "margin": margin, **({"failed": failed[name]} if failed else {})})
    bench.log(f"tune: {trial.label}: {name}'s replayed lead confirmed: {now[name]:.3f} ms now ({cached:.3f} ms in "
              f"the timing cache), {runner_up} {against:.3f} ms")


def open_candidate(cand: Candidate, models: dict[str, onnx.ModelProto], target, work: Path, tuning_db: Path,
                   int8: Int8 | None = None, runner: Runner | None = None, *, source: Path | None = None) -> Handle:
    """The candidate built as a bundle of its own in `work` (`build`) and opened to be checked by `runner`
    (`timing.FreshProcess` unless given); on this host, one of at most `CHECKED_APART_BYTES` of weights is
    opened in this process instead, by the runtime's executor, which runs what a device runs."""
    runner = runner or FreshProcess()
    build(cand, models, target, work, tuning_db, int8, source=source)
    if not runner.local:
        return runner.open(work)
    if sum(irm.weight_bytes(m) for m in models.values()) > CHECKED_APART_BYTES:
        give_back()  # what the compilers freed, before the child that runs it loads its weights
        return runner.open(work)
    return InProcess().open(work)


def build(cand: Candidate, models: dict[str, onnx.ModelProto], target, work: Path, tuning_db: Path,
          int8: Int8 | None = None, *, source: Path | None = None):
    """The candidate's bundle written in `work`: each segment compiled by its backend (one that quantizes
    first quantized, as the compress stage will, on `int8`'s calibration samples; `OWN` copies `source`, the
    imported TFLite file), a manifest with its parallel steps. Returns the manifest."""
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
                                                 keep_kernel_times=True, source=source))
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


class Disagrees(ValueError):
    """A candidate's output off the reference: `share`, how far, of the output's scale."""

    def __init__(self, message: str, share: float):
        super().__init__(message)
        self.share = share


def check(handle: Handle, samples: list[dict], tolerance: float | None = None,
          quantized: frozenset[str] = frozenset(), against: str = "onnxruntime") -> None:
    """Every output the span hands on, within `tolerance` (TOLERANCE) of its scale (its largest magnitude)
    of onnxruntime on the float model, or, for an output a QuantizeLinear makes (`quantized`), within one step of
    its integers (another int8 kernel rounds its requantization otherwise); raises `Disagrees` saying which output
    is off and by how much."""
    tolerance = TOLERANCE if tolerance is None else tolerance
    for sample, got in zip(samples, _run_all(handle, samples)):
        for t in handle.outputs:
            err, scale = largest_difference(got[t.name], sample[t.name]), _scale(sample[t.name])
            allowed = max(tolerance * scale, 1.0 if t.name in quantized else 0.0)
            if not np.isfinite(err) or err > allowed:
                raise Disagrees(f"its {t.name} differs from {against} by {err:.3g} (scale {scale:.3g})",
                                err / scale if np.isfinite(err) else float("inf"))


def _scale(want) -> float:
    """An output's scale, which the check's tolerance is a share of: its largest magnitude (1e-6 at least)."""
    want = np.asarray(want, np.float64)
    return max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)


class SpanCheck:
    """`check` for one span's candidates, within the span's tolerance: TOLERANCE, or where a candidate misses it by
    less than FLOOR_PROBE, FLOOR_FACTOR times how far rounding alone moves the span's outputs (`_rounding_floor`,
    measured once per span and said in the log; `widened` then holds it for the span's record). An output a
    QuantizeLinear makes may be one integer step off. The measured and the policy choice check alike; each call
    names the span's float model (`model`, None where no whole-span candidate has one), which the candidates share.
    Against a quantized model's own file (`exact`), nothing is widened: its int8 arithmetic is specified to the bit,
    and how far onnxruntime's rounding moves the span measures onnxruntime, not the candidate."""

    def __init__(self, label: str, log: Callable[[str], None], exact: bool = False):
        self.label, self.log, self.exact = label, log, exact
        self.quantized: frozenset[str] | None = None
        self.tolerance: float | None = None
        self.widened: dict | None = None

    def __call__(self, handle: Handle, values: list[dict], model: onnx.ModelProto | None) -> None:
        if self.quantized is None:
            self.quantized = _quantized_outputs(model) if model is not None else frozenset()
        against = "LiteRT on the model's own file" if self.exact else "onnxruntime"
        try:
            check(handle, values, self.tolerance, self.quantized, against)
        except Disagrees as e:
            if self.tolerance is not None or e.share > FLOOR_PROBE or self.exact:
                raise
            floor = _rounding_floor(model, values) if model is not None else 0.0
            self.tolerance = max(TOLERANCE, FLOOR_FACTOR * floor)
            if self.tolerance > TOLERANCE:
                self.widened = {"rounding_floor": round(floor, 6), "tolerance": round(self.tolerance, 6)}
                self.log(f"tune: {self.label}: one float32 rounding step in its inputs moves its outputs by "
                         f"{floor:.2%} of their scale: candidates are checked within {self.tolerance:.2%}")
            check(handle, values, self.tolerance, self.quantized, against)


def _verify(handle: Handle, cand: Candidate, models: dict[str, onnx.ModelProto], trial: _Trial, bench: _Bench
            ) -> dict | None:
    """A built candidate held to what its span asks: a float one checked (`_check_span`), a reduced one gated on the
    held-out samples; in the span of a whole quantized TFLite model (`bench.own`), every one gated against the
    model's own file too. The gate's figures, None where it was only checked; raises where it fails."""
    if not _reduced(cand):
        _check_span(handle, trial, bench)
        if bench.own is None:
            return None
    return _gated(handle, bench.int8 if _reduced(cand) else None, cand, models, bench.model_outputs, bench.own)


def _gate_digest(cand: Candidate, bench: _Bench) -> str:
    """What a candidate's gate depends on beside its own bytes (the timing cache's key): the calibration and
    held-out samples of a reduced one, the own file and its held-out outputs in a whole quantized model's span."""
    parts = ([bench.int8.digest] if _reduced(cand) else []) + ([bench.own.digest] if bench.own is not None else [])
    return ":".join(parts)


@dataclass(frozen=True)
class _Own:
    """A quantized TFLite model's own file where one CPU span holds the whole model: the reference that span's
    candidates are checked against (`values`: the check samples, with LiteRT's outputs on them, int8 codes as the
    model gives them) and gated against (`held`: the held-out samples, with LiteRT's outputs as the values its
    codes stand for, `grids`); `digest` keys the timing cache."""

    path: Path
    values: list[dict]
    held: list[dict]
    grids: dict[str, tuple[float, int]]
    digest: str
    against: str = "the model's own int8 (LiteRT)"

    @staticmethod
    def of(path: Path, model: onnx.ModelProto, values: list[dict], samples: list[dict],
           log: Callable[[str], None]) -> "_Own | None":
        """The reference, or None (said in the log) where LiteRT cannot run the file on the samples as the graph
        takes them."""
        outputs = [o.name for o in model.graph.output]
        why = own_tflite.mismatch(path, model)
        _, held = held_out_split(samples)
        checked = own_tflite.outputs(path, values, outputs) if why is None else None
        gated = own_tflite.outputs(path, held, outputs) if checked is not None else None
        if checked is None or gated is None:
            log(f"tune: the imported TFLite file is not the reference: {why or 'LiteRT cannot run it on the samples'}; "
                "candidates are checked against onnxruntime on the imported graph")
            return None
        grids = own_tflite.output_grids(path)
        h = hashlib.sha256(file_sha256(path).encode())
        for sample, out in zip(held, gated):
            both = {**sample, **out}
            for name in sorted(both):
                h.update(name.encode())
                h.update(np.ascontiguousarray(both[name]).tobytes())
        log(f"tune: the model's own TFLite file is the reference: its span's candidates are checked against LiteRT "
            f"on it, and gated against it on {len(held)} held-out sample(s)")
        return _Own(path, [{**v, **o} for v, o in zip(values, checked)],
                    [{**sample, **_decoded(out, grids)} for sample, out in zip(held, gated)], grids, h.hexdigest())

    def decode(self, got: dict) -> dict:
        return _decoded(got, self.grids)

    def describe(self) -> str:
        return "the imported TFLite file on LiteRT (the model's own int8 arithmetic)"


def _decoded(values: dict, grids: dict[str, tuple[float, int]]) -> dict:
    """Integer outputs as the values their codes stand for (scale, zero point); the others as they are."""
    return {k: ((np.asarray(v, np.float32) - grids[k][1]) * np.float32(grids[k][0])
                if k in grids and np.asarray(v).dtype.kind in "iu" else v) for k, v in values.items()}


def _check_span(handle: Handle, trial: _Trial, bench: _Bench) -> None:
    """The span's `SpanCheck` on a float candidate, its widened tolerance in the span's record as `check_tolerance`."""
    whole = next((c for c in trial.cands if c.name != PLANNED), None)
    model = trial.cut[whole.name][whole.segments[0].id] if whole is not None else None
    if trial.span_check is None:
        trial.span_check = SpanCheck(trial.label, bench.log, exact=bench.own is not None)
    try:
        trial.span_check(handle, bench.values, model)
    finally:
        if trial.span_check.widened:
            trial.entry["check_tolerance"] = trial.span_check.widened


def _quantized_outputs(model: onnx.ModelProto) -> frozenset[str]:
    """The model's outputs a QuantizeLinear makes."""
    made_by = {o: n.op_type for n in model.graph.node for o in n.output}
    return frozenset(o.name for o in model.graph.output
                     if made_by.get(o.name) in ("QuantizeLinear", "DynamicQuantizeLinear"))


def _rounding_floor(model: onnx.ModelProto, values: list[dict]) -> float:
    """How far rounding alone moves the span's outputs: onnxruntime on the span's model, each float input moved by one
    float32 rounding step (`numeric.nudged` by 2^-24, a seeded random direction per element), against the reference
    values; the largest share of an output's scale (`_scale`, as `check` measures it), 0 where it cannot run. A kernel that sums
    in another order rounds each sum differently by about that much: a model that amplifies it is not checked more
    tightly than it computes."""
    from ..backends import onnxruntime as ort_backend

    inits = {i.name for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    outputs = [o.name for o in model.graph.output]
    rng = np.random.default_rng(0)
    try:
        got = ort_backend.run_many(model, [{n: nudged(v[n], rng, 2.0**-24) for n in inputs} for v in values], outputs)
    except Exception:  # noqa: BLE001 -- onnxruntime's own exception types: no floor to measure, TOLERANCE stands
        return 0.0
    shares = [largest_difference(g[name], want[name]) / _scale(want[name]) for want, g in zip(values, got)
              for name in outputs]
    give_back()
    return max((s for s in shares if np.isfinite(s)), default=0.0)


def _run_all(handle: Handle, samples: list[dict]) -> list[dict]:
    """The bundle's outputs on each sample (a candidate on a board runs them all in one session)."""
    feeds = [{t.name: sample[t.name] for t in handle.inputs} for sample in samples]
    if hasattr(handle, "run_all"):
        return handle.run_all(feeds)
    return [handle.run(f) for f in feeds]  # an opened bundle that runs one sample at a time (BundleModel)


def gate(bundle, held_out: list[dict], model_outputs: Sequence[str], *, decode: Callable[[dict], dict] | None = None,
         against: str = "fp32") -> dict:
    """An int8 candidate against the fp32 model (or `against`: the reference `held_out`'s outputs hold) on held-out
    samples: each output's cosine similarity over the samples (of its values as `decode` makes them, where given),
    and for the model's class-score outputs (rank 2 or 3, a last axis of 2 or more) how often the arg max of the last
    axis agrees. Raises where the least cosine is under GATE_COSINE or an agreement under GATE_TOP1; else the
    figures (the least of each)."""
    from ..ir.numeric import fidelity

    got = _run_all(bundle, held_out)
    cosines, agreements = fidelity([decode(g) for g in got] if decode else got, held_out, model_outputs)
    worst = min(cosines, key=cosines.get)
    if cosines[worst] < GATE_COSINE:
        raise ValueError(f"accuracy gate: {worst}'s cosine similarity to {against} is {cosines[worst]:.4f} < "
                         f"{GATE_COSINE} on {len(held_out)} held-out samples")
    result: dict = {"cosine": cosines[worst], "top1": None, "samples": len(held_out)}
    if agreements:
        least = min(agreements, key=agreements.get)
        if agreements[least] < GATE_TOP1:
            raise ValueError(f"accuracy gate: {least}'s top-1 agrees with {against} on {agreements[least]:.0%} < "
                             f"{GATE_TOP1:.0%} of {len(held_out)} held-out samples")
        result["top1"] = agreements[least]
    return result


def _gated(bundle, int8: Int8 | None, cand: Candidate, models: dict[str, onnx.ModelProto],
           model_outputs: Sequence[str], own: "_Own | None" = None) -> dict:
    """`gate` on the held-out samples (`own`'s, against the model's own file, where given); a refusal of a
    mixed-precision candidate says how many ops it kept float."""
    try:
        if own is not None:
            return gate(bundle, own.held, model_outputs, decode=own.decode, against=own.against)
        return gate(bundle, int8.held_out, model_outputs)
    except ValueError as e:
        found = int8.mixed_of(cand, models) if int8 is not None else None
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


def _reduced(cand: Candidate) -> bool:
    """A candidate computing below float32 (int8, bf16, fp16): gated against fp32 instead of checked within its tolerance."""
    return cand.name != PLANNED and any(backends.backend(s.backend).precision != "fp32" for s in cand.segments)


def _rounds(checked: dict[str, tuple[Candidate, Checked]], sample: dict, timer: Timer, work: Path,
            runner: Runner, rounds: int = ROUNDS, laps: dict[str, list[float]] | None = None
            ) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
    """Median milliseconds of one inference of each candidate: `rounds` measurements of each, in turn,
    each by `runner` (in a fresh process that loads the candidate's bundle alone: as on a device, no other
    runtime's threads spinning on the cores) of `RUNS` inferences after `WARMUP`; the median of them all.
    A candidate whose timing run fails is left out, with why. And each one's noise: how far apart its
    rounds were, a share of its median (`_spread`). `laps` holds each one's earlier rounds, which count with
    these (and gets these added)."""
    feeds = work / "feeds.npz"
    np.savez(feeds, **{t.name: sample[t.name] for _, b in checked.values() for t in b.inputs})
    laps = {} if laps is None else laps
    for name in checked:
        laps.setdefault(name, [])
    failed: dict[str, str] = {}
    for _ in range(rounds):
        for name, (_, bundle) in checked.items():
            if name in failed:
                continue
            try:
                laps[name].append(timer(name, lambda b=bundle: statistics.median(
                    runner.measure(b.bundle, feeds, warmup=WARMUP, runs=RUNS))))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed[name] = failure(e)
    kept = {n: laps[n] for n in checked if n not in failed}
    return ({n: round(statistics.median(v), 4) for n, v in kept.items()}, failed,
            {n: _spread(v) for n, v in kept.items()})


def _spread(rounds: list[float]) -> float:
    """How far a candidate's round medians are apart, as a share of their median: the noise its time carries."""
    middle = statistics.median(rounds)
    return round((max(rounds) - min(rounds)) / middle, 4) if middle > 0 and len(rounds) > 1 else 0.0


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
                         threads, _versions(cand), CHECK_RULES] + ([samples] if samples else [])).encode())
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


def copy_file(src: Path, dest: Path) -> None:
    """A hard link where the file system allows one (segment models can be large), else a copy; a
    model's external data (`irm.save`'s `.data` beside it) with it."""
    data = src.with_name(src.name + ".data")
    for a, b in ((src, dest), *([(data, dest.with_name(dest.name + ".data"))] if data.is_file() else [])):
        try:
            os.link(a, b)
        except OSError:
            shutil.copyfile(a, b)
