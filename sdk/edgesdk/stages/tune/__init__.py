"""tune: search tensor programs for the segments of every backend that tunes (TVM, for the CPU and GPU:
MetaSchedule), through the backend registry (`Backend.tune`); then put every CPU span on the backend
measured fastest (`scheduling.selection`: the plan's cut, TVM, onnxruntime or LiteRT fp32 for the
whole span, each checked against onnxruntime and timed on this host when it runs the target's CPU code).
Where this host cannot run it (an aarch64 target on an x86-64 host), each span's backend is chosen by
policy, not timed: the plan's cut where the tuning database holds tuned TVM records for all of its
functions, else LiteRT/XNNPACK fp32 where it lowers every node and agrees with onnxruntime here, else the
plan's cut.

Needs: the plan and its segment models; the imported model's inputs (for calibration samples).
Guarantees: `plan.json`, the plan with the chosen backends (its `cpu_selection` says what was measured,
what was chosen and why), `segments/` and `model.onnx` for it; `tuning_db/`, a copy of the tuning
database (with its timing cache) as the package stage will apply it (so a rebuild replays exactly
these records and measurements), `tune.json` with a summary per device kind and per task (trials,
untuned and best latency, speedup), and MetaSchedule's logs in `logs/`.
With `--trials 0` (the default) nothing is searched: records already in the database are used.
`--cpu-backends` restricts the CPU candidates. `--cpu-precision int8` (or the target's CPU `precision:
int8`) adds int8 candidates (LiteRT's and onnxruntime's int8 kernels, quantized with the build's
calibration samples less a held-out quarter), each admitted only where it passes the accuracy gate
on the held-out samples (`selection.gate`); each one chosen is quantized here as it was measured
(`int8/segments/`, `int8.json`: its record and the calibration), for the package stage.
The database (`--tuning-db`, default under the user's cache directory, one per target) is
persisted between builds and shared between models: a workload searched before with at least
this budget costs no trials, and every record trains the cost model before a new search
(transfer). The segments of one device kind are searched together, so `--trials` is the
budget per device kind (CPU, GPU) of the model, and `--time-budget` the stage's wall time.
Candidates are measured here, or with `--rpc-tracker`/`--rpc-key` on the boards registered
with a TVM RPC tracker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import onnx

from ... import backends
from ...compression import build as pruning
from ...config import HOST
from ...errors import UserError
from ...ir import model as irm
from ...ir.calibration import load_calibration
from ...ir.digest import tree_sha256
from ...scheduling import boards as on_boards
from ...scheduling import selection
from ...scheduling.plan import Plan

OPTIONS = ("trials", "time_budget", "tuning_db", "seed", "rpc_tracker", "rpc_key", "cpu_backends", "cpu_precision",
           "calib", "calib_samples", "calib_preprocess", "calib_method", "calib_percentile", "prune", "prune_layers",
           "sparse_kernels")
READS = ("import", "schedule")  # the earlier stages whose outputs it reads (its cache key covers them)
TIMING_CACHE = "timing.json"  # in the database: the CPU candidates' measured times


def default_tuning_db(target_name: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edgesdk" / "tuning" / target_name


def _db_path(options, target) -> Path:
    return Path(options.tuning_db) if options.tuning_db else default_tuning_db(target.name)


def cache_inputs(options, target) -> dict:
    """The database's content decides what the package stage compiles: a changed database is a miss.
    Its timing cache is left out: it only replays what this stage measured (a rebuild that measures
    nothing new chooses the same), and a build's own measurements must not make the next one a miss."""
    db = _db_path(options, target)
    # a database not made yet is an empty one: the build makes it; the backends' kernel times are its
    # measurements too (left out alike)
    kinds = [d.name for d in db.iterdir() if d.is_dir()] if db.is_dir() else []
    return {"tuning_db_sha256": tree_sha256(db, exclude=(TIMING_CACHE, *(f"{k}/{backends.KERNEL_TIMES}"
                                                                          for k in kinds)))}


def run(artifact: Path, ctx) -> dict:
    plan = Plan.load(artifact)
    db = _db_path(ctx.options, ctx.target)
    db.mkdir(parents=True, exist_ok=True)
    boards = None
    if ctx.options.rpc_tracker or ctx.options.rpc_key:
        boards = backends.Boards.parse(ctx.options.rpc_tracker or "", ctx.options.rpc_key or "")
    pruned = _pruned(plan, artifact, ctx)
    kinds = _search(plan, artifact, db, boards, ctx, _loader(artifact, pruned))
    selected = _select(plan, artifact, db, ctx, boards, pruned)
    _write_plan(selected, artifact, ctx.out)
    (ctx.out / "int8.json").write_text(json.dumps({"segments": selected.quantized, "calibration": selected.calibration},
                                                  indent=2) + "\n")
    shutil.copytree(db, ctx.out / "tuning_db", ignore=shutil.ignore_patterns("*.tmp"))
    record = {"database": str(db), "database_sha256": tree_sha256(ctx.out / "tuning_db"),
              "database_records": _records(ctx.out / "tuning_db"),
              "trials": ctx.options.trials, "time_budget_s": ctx.options.time_budget, "seed": ctx.options.seed,
              "measured_on": str(boards) if boards else "this host", "kinds": kinds,
              "cpu_selection": selected.record}
    (ctx.out / "tune.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def _pruned(plan: Plan, artifact: Path, ctx) -> tuple[onnx.ModelProto, onnx.ModelProto, list[dict]] | None:
    """With `--prune`: the model as scheduled, the same with its CPU layers pruned as the compress stage will
    prune them (the same masks: the same function of the same model and options), and the pruned layers'
    records; None without. The search tunes, and the selection times, what the pruned segments compile to."""
    if not ctx.options.prune:
        return None
    dense = onnx.load(str(artifact / "model.onnx"))
    accelerated = {n for s in plan.segments if s.device.split(":")[0] != HOST for n in s.nodes}
    model, layers, _, _ = pruning.prune_for_build(dense, ctx.options.prune, ctx.options.prune_layers, accelerated,
                                                  ctx.options.sparse_kernels)
    return dense, model, layers


def _loader(artifact: Path, pruned):
    """A segment's model as this stage searches and times it: as scheduled, its layers pruned where `pruned`."""
    if pruned is None:
        return lambda s: onnx.load(str(artifact / s.artifact))
    _, model, layers = pruned
    return lambda s: pruning.apply(onnx.load(str(artifact / s.artifact)), model, layers)


def _search(plan: Plan, artifact: Path, db: Path, boards, ctx, load) -> dict[str, dict]:
    """Each tuning backend's search over its segments (`load`ed), one device kind at a time: the summary per
    kind."""
    by_kind: dict[str, list] = {}  # the segments of a tuning backend, per device kind (one such backend today)
    for seg in plan.segments:
        if backends.backend(seg.backend).tunes:
            by_kind.setdefault(seg.device.split(":")[0], []).append(seg)
    kinds: dict[str, dict] = {}
    start = time.monotonic()
    budget_s = ctx.options.time_budget
    for n, (kind, segments) in enumerate(by_kind.items()):
        ids = [s.id for s in segments]
        if ctx.options.trials <= 0:
            kinds[kind] = {"segments": ids, "trials": 0,
                           "note": "no search (--trials 0): records in the database are applied"}
            continue
        device = ctx.target.device(kind)
        left = None
        if budget_s:  # what is left of the stage's time, shared by the kinds still to tune
            left = max(0.0, budget_s - (time.monotonic() - start)) / (len(by_kind) - n)
        where = f"on {boards.key} boards via {boards.host}:{boards.port}" if boards else "on this host"
        ctx.log(f"tune: {kind}: segments {', '.join(ids)}: up to {ctx.options.trials} trials"
                + (f" or {_duration(left)}" if left is not None else "") + f", measured {where}")
        bar = _Bar(ctx, kind)
        summary = backends.backend(segments[0].backend).tune(backends.TuneJob(
            kind=kind, models=tuple(load(s) for s in segments), device=device,
            tuning_db=db / kind,  # one database per device kind: MetaSchedule keys records by workload, not target
            trials=ctx.options.trials, time_budget_s=left, seed=ctx.options.seed, boards=boards,
            log_dir=ctx.out / "logs" / kind, progress=bar, log=ctx.log))
        bar.close()
        summary["segments"] = ids
        kinds[kind] = summary
        _report(kind, summary, ctx)
    return kinds


def _report(kind: str, summary: dict, ctx) -> None:
    for line in describe(kind, summary):
        ctx.log(line)
    if summary["failures"]["build"] or summary["failures"]["run"]:
        f = summary["failures"]
        ctx.warn(f"tune: {kind}: {f['build']} candidate(s) failed to build and {f['run']} to run; "
                 f"the search went on with the rest; first: {f['messages'][0]}")
    if summary["stopped"] == "boards-lost":
        ctx.warn(f"tune: {kind}: search stopped early: {summary.get('stop_message', '')}; the records measured "
                 f"are kept, and the next build with the same --trials resumes the search")
    elif summary["stopped"] == "time":
        ctx.log(f"tune: {kind}: --time-budget reached; the next build with the same --trials resumes the search")


def _select(plan: Plan, artifact: Path, db: Path, ctx, boards=None, pruned=None) -> selection.Selected:
    """Every CPU span on the backend measured fastest (`scheduling.selection`): on this host, or on
    `boards` where this host cannot run the target's CPU code."""
    # the whole-span candidates; the schedule's own cut is always one (`--cpu-backends planned`: the only one)
    allowed = [b for b in selection.CPU_BACKENDS if b in (ctx.options.cpu_backends or selection.CPU_BACKENDS)]
    why = selection.unmeasurable(ctx.target)
    # the model and the calibration samples only where a span will be measured, or checked for the policy's
    # LiteRT candidate (an arm_2tpu build on an x86 host with --cpu-backends planned reads nothing again)
    reads = bool(selection.spans(plan)) and (why is None or boards is not None or selection.POLICY in allowed)
    layers: list[dict] = []
    if pruned is not None and reads:
        # the candidates are timed on the weights the compress stage will prune; the segments this stage
        # writes stay dense
        dense, model, layers = pruned
        ctx.log(f"tune: CPU candidates are timed with {len(layers)} layer(s) pruned ({ctx.options.prune})")
    else:
        model = onnx.load(str(artifact / "model.onnx")) if reads else None
    io = json.loads((ctx.artifact("import") / "import.json").read_text())
    samples, calib_info = load_calibration(ctx.options, io["inputs"]) if reads else ([], {})
    precision = cpu_precision(ctx.options, ctx.target)
    if precision == "int8" and reads and calib_info.get("synthetic"):
        ctx.warn(f"--cpu-precision int8 with no --calib data: int8 candidates are calibrated and gated on "
                 f"{len(samples)} synthetic samples (uniform in [-1, 1]); give real inputs with --calib")
    board = None
    if boards is not None and why is not None and reads:  # timed on a board where it runs edgesdk's server
        try:
            board = on_boards.describe(boards)
        except UserError as e:
            if e.code != "tune.board-server":
                raise
            ctx.warn(f"tune: {e.message}; each CPU span's backend is chosen by policy instead. {e.hint}")
    selected = selection.select(
        plan, model, _loader(artifact, pruned), ctx.target, samples, allowed=allowed,
        tuning_db=db / "cpu", cache=selection.TimingCache(db / TIMING_CACHE), measurable=why,
        host=selection.host_name(), log=ctx.log, precision=precision,
        calib_method=ctx.options.calib_method, calib_percentile=ctx.options.calib_percentile, int8_dir=ctx.out / "int8",
        boards=boards if board is not None else None, board=board)
    if layers:  # the segments re-cut from the pruned model get their dense weights back
        selected = dataclasses.replace(selected, models={k: pruning.apply(m, dense, layers)
                                                         for k, m in selected.models.items()})
    if selected.quantized:
        calib_info = {**calib_info, "method": ctx.options.calib_method}
        if ctx.options.calib_method == "percentile":
            calib_info["percentile"] = ctx.options.calib_percentile
        selected = dataclasses.replace(selected, calibration=calib_info)
    return selected


def cpu_precision(options, target) -> str:
    """`--cpu-precision`, else the target's CPU `precision` (fp32 by default)."""
    return options.cpu_precision or target.host.precision


def _write_plan(selected: selection.Selected, scheduled: Path, out: Path) -> None:
    """plan.json, segments/ and model.onnx as the package stage reads them: the schedule's files linked,
    the segments the selection cut anew written."""
    (out / "segments").mkdir()
    for s in selected.plan.segments:
        if s.id in selected.models:
            irm.save(selected.models[s.id], out / s.artifact)
        else:
            selection.copy_file(scheduled / s.artifact, out / s.artifact)
    selection.copy_file(scheduled / "model.onnx", out / "model.onnx")
    (out / "plan.json").write_text(selected.plan.to_json())


def describe(kind: str, summary: dict) -> list[str]:
    """The per-task summary table of one device kind's search, as log lines."""
    head = (f"tune: {kind}: {summary['tasks']} tasks, {summary['searched']} searched, {summary['reused']} reused "
            f"from the database; {summary['trials']} candidates measured in {_duration(summary.get('wall_s', 0))} "
            f"(stopped: {summary['stopped']})")
    lines = [head]
    if summary.get("transfer"):
        lines.append(f"      cost model first trained on {summary['transfer']['records']} records of "
                     f"{summary['transfer']['workloads']} workloads in the database")
    lines.append(f"      {'task':<44} {'weight':>6} {'trials':>6} {'untuned ms':>11} {'best ms':>9} {'speedup':>8}")
    for t in summary["per_task"]:
        untuned = f"{t['untuned_ms']:.4f}" if t["untuned_ms"] is not None else "-"
        best = f"{t['best_ms']:.4f}" if t["best_ms"] is not None else "-"
        speedup = f"{t['speedup']:.2f}x" if t["speedup"] else "-"
        name = t["name"] if len(t["name"]) <= 44 else t["name"][:41] + "..."
        lines.append(f"      {name:<44} {t['weight']:>6} {t['trials']:>6} {untuned:>11} {best:>9} {speedup:>8}")
    return lines


class _Bar:
    """The search's progress bar: measured / budget, the best latency of the task just measured,
    failures and elapsed time; redrawn in place on a terminal (`ctx.progress`)."""

    def __init__(self, ctx, kind: str) -> None:
        self.ctx, self.kind = ctx, kind
        self.shown = False

    def __call__(self, p) -> None:
        width = 24
        filled = min(width, int(width * p.measured / max(1, p.budget)))
        best = p.best_ms.get(p.task)
        line = (f"tune: {self.kind} [{'#' * filled}{'.' * (width - filled)}] {p.measured}/{p.budget} trials | {p.task}: "
                + (f"best {best:.4f} ms" if best is not None else "no valid candidate yet")
                + f" | {_duration(p.elapsed_s)}" + (f" | {p.failed} failed" if p.failed else ""))
        (self.ctx.progress or self.ctx.log)(line)
        self.shown = True

    def close(self) -> None:
        if self.shown and self.ctx.progress is not None:
            self.ctx.progress(None)  # end the redrawn line


def _records(db: Path) -> int:
    return sum(sum(1 for line in f.read_bytes().splitlines() if line.strip())
               for f in db.glob("*/database_tuning_record.json"))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
