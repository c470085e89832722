"""tune: search tensor programs for the segments of every backend that tunes (TVM, for the CPU and GPU:
MetaSchedule), through the backend registry (`Backend.tune`); then put every CPU span on the backend
measured fastest (`scheduling.selection`: the plan's cut, TVM, onnxruntime, LiteRT fp32 or OpenVINO fp32
for the whole span, each checked against onnxruntime and timed on this host when it runs the target's CPU code).
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
calibration samples less a held-out quarter), `bf16` bfloat16 ones (OpenVINO's, where the target's CPU
has AVX512_BF16 or AMX), `auto` both; each is admitted only where it passes the accuracy gate on the
held-out samples (`selection.gate`); each int8 one chosen is quantized here as it was measured
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
from ...compression import plan as prune_plan
from ...compression.prune import parse_method, prunable
from ...config import HOST
from ...errors import UsageError, UserError
from ...frontends import OWN_TFLITE
from ...ir import model as irm
from .. import memory as build_memory
from ...ir.calibration import load_calibration, synthetic_warnings
from ...ir.digest import file_sha256, tree_sha256
from ...scheduling import boards as on_boards
from ...scheduling import selection
from ...scheduling.plan import Plan
from ...timing import TimingCache

OPTIONS = ("trials", "time_budget", "tuning_db", "seed", "rpc_tracker", "rpc_key", "cpu_backends", "cpu_precision",
           "calib", "calib_samples", "calib_preprocess", "calib_method", "calib_percentile", "input_ranges", "prune",
           "prune_layers",
           "sparse_kernels", "prune_plan", "latency_budget", "low_memory")
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
    plan = options.prune_plan
    return {"tuning_db_sha256": tree_sha256(db, exclude=(TIMING_CACHE, *(f"{k}/{backends.KERNEL_TIMES}"
                                                                          for k in kinds))),
            # a plan file's content, not its path
            **({"prune_plan_sha256": file_sha256(Path(plan)) if Path(plan).is_file() else None}
               if plan not in (None, "auto") else {})}


def run(artifact: Path, ctx) -> dict:
    plan = Plan.load(artifact)
    db = _db_path(ctx.options, ctx.target)
    db.mkdir(parents=True, exist_ok=True)
    boards = None
    if ctx.options.rpc_tracker or ctx.options.rpc_key:
        boards = backends.Boards.parse(ctx.options.rpc_tracker or "", ctx.options.rpc_key or "")
    pruned = _pruned(plan, artifact, db, ctx)
    kinds = _search(plan, artifact, db, boards, ctx, _loader(artifact, pruned))
    selected = _select(plan, artifact, db, ctx, boards, pruned)
    if pruned is not None:
        _plan_measured(selected, ctx)
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


def _pruned(plan: Plan, artifact: Path, db: Path, ctx) -> tuple[onnx.ModelProto, onnx.ModelProto, list[dict]] | None:
    """With `--prune` or `--prune-plan`: the per-layer plan written (`pruning.PLAN_FILE`, what the compress
    stage prunes by), then the model as scheduled, the same with the plan's layers pruned as the compress
    stage will prune them (the same function of the same model and plan), and the pruned layers' records;
    None without. The search tunes, and the selection times, what the pruned segments compile to."""
    opts = ctx.options
    if not (opts.prune or opts.prune_plan):
        return None
    dense = irm.read(artifact / "model.onnx")
    accelerated = {n for s in plan.segments if s.device.split(":")[0] != HOST for n in s.nodes}
    if opts.prune_plan not in (None, "auto"):
        wanted = prune_plan.read_plan(Path(opts.prune_plan), prunable(dense))  # None: dense
        layers, accel = pruning.on_cpu(dense, [x for x in prunable(dense) if x.name in wanted], accelerated)
        methods = {x.name: wanted[x.name] for x in layers if wanted[x.name] is not None}
        record: dict = {"source": str(opts.prune_plan)}
        ctx.log(f"tune: prune plan from {opts.prune_plan}: {len(methods)} layer(s) to prune")
    else:
        layers, accel = pruning.candidates(dense, opts.prune_layers, accelerated)
        if opts.prune_plan == "auto":
            methods, record = _auto_plan(plan, artifact, dense, layers, db, ctx)
        else:
            methods, record = pruning.uniform(layers, opts.prune), {"source": f"--prune {opts.prune}"}
    pruning.save_plan(ctx.out / pruning.PLAN_FILE, methods, layers,
                      accelerator_layers_dense=[x.name for x in accel], **record)
    model, records, _ = pruning.prune_for_build(dense, methods, opts.sparse_kernels)
    return dense, model, records


def _auto_plan(plan: Plan, artifact: Path, dense: onnx.ModelProto, layers: list, db: Path, ctx
               ) -> tuple[dict, dict]:
    """`--prune-plan auto`: each candidate layer's method chosen under `--latency-budget` by dynamic
    programming over its kernels' times measured on this host and its sensitivity (compression/plan.py).

    The budget is the model's CPU time as the build will run it. Where the dense model already meets it on
    the backends the selection measures (onnxruntime may beat a dense TVM build), nothing is pruned. Else the
    plan is made for the TVM segments, the backend whose kernels pruning speeds up: the dense segments and
    the fastest plan's are timed whole, and the kernels' savings, timed alone, scaled to that difference."""
    opts = ctx.options
    why = selection.unmeasurable(ctx.target)
    if why is not None:
        raise UsageError("prune.plan-unmeasurable", f"--prune-plan auto times each layer's kernels on this host, and "
                         f"this host cannot run the target's CPU code ({why})",
                         hint="choose the plan on a host that runs the target's CPU code and give it here as "
                              "--prune-plan FILE (that build's OUT/.build/4-tune/prune_plan.json), or prune every layer alike "
                              "with --prune METHOD")
    timer = next((b for b in backends.backends() if b.layer_timer), None)
    if timer is None:
        raise UsageError("prune.plan-unmeasurable", "--prune-plan auto needs a backend that times layers (TVM), and "
                         "none is registered", hint="prune every layer alike with --prune METHOD")
    candidates = prune_plan.parse_candidates(opts.prune or prune_plan.DEFAULT_CANDIDATES)
    names = ", ".join(m.text for m in candidates)
    budget = opts.latency_budget
    record: dict = {"source": "auto", "budget_ms": budget, "candidates": [m.text for m in candidates],
                    "measured_on": selection.host_name()}
    if not layers:
        ctx.warn("--prune-plan auto: no layer to prune on the CPU; the model is unchanged")
        return {}, record
    io = json.loads((ctx.artifact("import") / "import.json").read_text())
    samples, calib = load_calibration(ctx.options, io["inputs"])
    best = _dense_best(plan, artifact, dense, samples, db, ctx)
    if best is not None:
        record["dense_best"] = {"ms": best[0], "backends": best[1]}
        if best[0] <= budget:
            ctx.log(f"tune: prune plan: the dense model runs in {best[0]:.3f} ms on {best[1]}, within the "
                    f"{budget:g} ms budget: nothing is pruned")
            return {}, {**record, "predicted_ms": best[0]}
    ctx.log(f"tune: prune plan: {len(layers)} candidate layer(s), methods {names}, budget {budget:g} ms "
            f"of CPU time: timing each layer's kernels on this host")
    cpu = [s for s in plan.segments if s.device.split(":")[0] == HOST and s.backend == timer.name]

    def timed(weights: dict, segments: dict) -> dict:
        return timer.time_layers(backends.LayerTimesJob(model=dense, weights=weights, segments=segments,
                                                        device=ctx.target.host, tuning_db=db / HOST, log=ctx.log))

    weights = {x.output: {m.text: pruning.pruned_weight(dense, x, m) for m in candidates} for x in layers}
    times = timed(weights, {"dense": tuple(irm.read(artifact / s.artifact) for s in cpu)})
    first = next(iter(samples[0].values()))  # a sample's batch rows: the first input's first axis
    rows = max(1, int(first.shape[0])) if first.ndim else 1
    few = samples[:max(1, prune_plan.SENSITIVITY_ROWS // rows)]
    sensitive = [x for x in layers if x.output in times["layers"]]
    ctx.log(f"tune: prune plan: the sensitivity of {len(sensitive)} layer(s) to {names} on {len(few)} "
            f"{'synthetic ' if calib.get('synthetic') else ''}calibration sample(s)")
    loss = prune_plan.sensitivity(dense, sensitive, candidates, few,
                                  progress=lambda i, n: ctx.log(f"tune: prune plan: sensitivity {i + 1}/{n}: "
                                                                f"{sensitive[i].name}"))
    options = prune_plan.options(layers, times["layers"], loss, candidates, opts.sparse_kernels)
    fastest = {k: parse_method(v) for k, v in prune_plan.fastest(options).items() if v != prune_plan.DENSE}
    model, records, _ = pruning.prune_for_build(dense, fastest, opts.sparse_kernels)
    whole = timed({}, {"fastest plan's": tuple(pruning.apply(irm.read(artifact / s.artifact), model, records)
                                               for s in cpu)})["segments_ms"]["fastest plan's"]
    chosen = prune_plan.choose(options, times["segments_ms"]["dense"], budget, fastest_ms=whole)
    pruned = {k: v for k, v in chosen.layers.items() if v != prune_plan.DENSE}
    record.update({"dense_ms": chosen.dense_ms, "predicted_ms": round(chosen.predicted_ms, 4),
                   "fastest_ms": round(chosen.fastest_ms, 4), "scale": round(chosen.scale, 4),
                   "loss": round(chosen.loss, 6), "segments_timed": [s.id for s in cpu],
                   "sensitivity_samples": len(few), "synthetic_samples": bool(calib.get("synthetic")),
                   "options": {k: [{"method": o.method, "ms": o.ms, "loss": round(o.loss, 6), "kernel": o.kernel}
                                   for o in v] for k, v in options.items()}})
    for line in prune_plan.table(record, chosen.layers):
        ctx.log(line)
    if not pruned:
        ctx.log(f"tune: prune plan: the dense TVM segments are predicted at {chosen.dense_ms:.3f} ms, within the "
                "budget: nothing is pruned")
    return {k: parse_method(v) for k, v in pruned.items()}, record


def _dense_best(plan: Plan, artifact: Path, dense: onnx.ModelProto, samples: list[dict], db: Path, ctx
                ) -> tuple[float, str] | None:
    """The dense model's CPU time as the selection runs it (each span's fastest candidate among the backends
    `--cpu-backends` allows, measured and cached as the selection does) and those backends; None where no
    span had a second candidate to time (`--cpu-backends planned`)."""
    cpu = backends.cpu_candidates()
    allowed = [b for b in cpu if b in (ctx.options.cpu_backends or cpu)]
    if not selection.spans(plan) or allowed == [] or ctx.options.cpu_backends == ("planned",):
        return None
    ctx.log("tune: prune plan: timing the dense model as the selection runs it")
    chosen = selection.select(plan, dense, lambda s: irm.read(artifact / s.artifact), ctx.target, samples,
                              allowed=allowed, tuning_db=db / HOST, cache=TimingCache(db / TIMING_CACHE),
                              measurable=None, host=selection.host_name(),
                              log=lambda line: ctx.log(line.replace("tune: ", "tune: prune plan: dense model: ", 1)))
    spans = chosen.record.get("spans", [])
    ms = [s["candidates"].get(s["chosen"], {}).get("ms") for s in spans]
    if not spans or any(m is None for m in ms):
        return None
    return round(sum(ms), 4), ", ".join(sorted({s["chosen"] for s in spans}))


def _plan_measured(selected: selection.Selected, ctx) -> None:
    """After the selection: the auto plan's prediction beside the CPU time measured for what was chosen."""
    if ctx.options.prune_plan != "auto":
        return
    path = ctx.out / pruning.PLAN_FILE
    data = json.loads(path.read_text())
    spans = selected.record.get("spans", [])
    times = [s["candidates"].get(s["chosen"], {}).get("ms") for s in spans]
    if not spans or any(t is None for t in times) or "predicted_ms" not in data:
        return
    measured = round(sum(times), 4)
    data["measured_ms"] = measured
    (ctx.out / pruning.PLAN_FILE).write_text(json.dumps(data, indent=2) + "\n")
    say = ctx.warn if measured > data["budget_ms"] else ctx.log
    say(f"tune: prune plan: predicted {data['predicted_ms']:.3f} ms; the CPU candidates chosen measured "
        f"{measured:.3f} ms end to end" + (f", over the {data['budget_ms']:g} ms budget (the prediction adds "
                                           "kernels timed alone)" if measured > data["budget_ms"] else ""))


def _loader(artifact: Path, pruned):
    """A segment's model as this stage searches and times it: as scheduled, its layers pruned where `pruned`."""
    if pruned is None:
        return lambda s: irm.read(artifact / s.artifact)
    _, model, layers = pruned
    return lambda s: pruning.apply(irm.read(artifact / s.artifact), model, layers)


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
    cpu = backends.cpu_candidates()
    allowed = [b for b in cpu if b in (ctx.options.cpu_backends or cpu)]
    only = build_memory.LOW_MEMORY_BACKENDS if ctx.options.low_memory else None
    if only:
        allowed = [b for b in allowed if b in only]
    why = selection.unmeasurable(ctx.target)
    # the model and the calibration samples only where a span will be measured, or checked for the policy's
    # LiteRT candidate (an arm_2tpu build on an x86 host with --cpu-backends planned reads nothing again)
    reads = bool(selection.spans(plan)) and (why is None or boards is not None or backends.policy_fallback() in allowed)
    layers: list[dict] = []
    if pruned is not None and reads:
        # the candidates are timed on the weights the compress stage will prune; the segments this stage
        # writes stay dense
        dense, model, layers = pruned
        ctx.log(f"tune: CPU candidates are timed with {len(layers)} layer(s) pruned ("
                + (f"--prune-plan {ctx.options.prune_plan}" if ctx.options.prune_plan else ctx.options.prune) + ")")
    else:
        model = irm.read(artifact / "model.onnx") if reads else None
    io = json.loads((ctx.artifact("import") / "import.json").read_text())
    samples, calib_info = load_calibration(ctx.options, io["inputs"]) if reads else ([], {})
    precision = cpu_precision(ctx.options, ctx.target)
    if precision != "fp32" and reads and calib_info.get("synthetic"):
        for line in synthetic_warnings(calib_info, len(samples), f"--cpu-precision {precision} candidates are "
                                       "calibrated and gated", {"auto": "reduced-precision"}.get(precision, precision)):
            ctx.warn(line)
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
        tuning_db=db / "cpu", cache=TimingCache(db / TIMING_CACHE), measurable=why,
        host=selection.host_name(), log=ctx.log, precision=precision,
        calib_method=ctx.options.calibration_method(), calib_percentile=ctx.options.calib_percentile,
        int8_dir=ctx.out / "int8",
        boards=boards if board is not None else None, board=board, only=only, own=_own_file(ctx, pruned))
    busy = [s["host_busy"] for s in selected.record.get("spans", []) if "host_busy" in s]
    if busy:
        ctx.warn(f"tune: other processes took up to {max(busy):.0%} of the CPU while {len(busy)} CPU span(s)' "
                 "candidates were timed: the backend chosen may not be the fastest where the bundle runs alone; "
                 "these times are not cached, so a build on a quiet host measures them again")
    if layers:  # the segments re-cut from the pruned model get their dense weights back
        selected = dataclasses.replace(selected, models={k: pruning.apply(m, dense, layers)
                                                         for k, m in selected.models.items()})
    if selected.quantized:
        calib_info = {**calib_info, "method": ctx.options.calibration_method()}
        if calib_info["method"] in ("percentile", "auto"):
            calib_info["percentile"] = ctx.options.calib_percentile
        selected = dataclasses.replace(selected, calibration=calib_info)
    return selected


def _own_file(ctx, pruned) -> Path | None:
    """A quantized TFLite model's own file, which the import kept (`frontends.OWN_TFLITE`), where the candidates
    are timed on the model as imported (not on weights --prune will change); None otherwise."""
    own = ctx.artifact("import") / OWN_TFLITE
    return own if own.is_file() and pruned is None and not ctx.options.prune else None


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
