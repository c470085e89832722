"""MetaSchedule tuning of TVM segments: budgeted, resumable, transferable, local or remote.

    tune: the segments' fused TIR functions (lowering.py's `_lower`, the same as compilation's), merged
          across segments by workload --default schedule measured (the untuned baseline,
          committed as a record)--> XGBoost cost model trained on every record already in
          the database (transfer) --evolutionary search, candidates built here and measured
          here or on boards behind a TVM RPC tracker--> records appended to the JSON database

The database is a directory (one per target, `target.json` names it) holding MetaSchedule's
two JSON-lines files and two of ours: `searched.json` (workload -> the largest budget a
finished search had, so that a workload seen before costs no trials) and `baseline.json`
(workload -> the untuned default schedule's latency, for the speedup in the summary).
A search stopped early (time budget, interrupt, boards lost) keeps every record it measured
and is not marked finished, so the next run resumes it with what is left of the budget.

    tuning.py    `tune_onnx`: tasks, budget, the untuned baseline and transfer, the summary
    search.py    the search loop and what watches it
    builder.py   candidates built (cross-linked for a foreign CPU)
    runner.py    candidates measured here or on boards over RPC
    database.py  the database directory
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ...errors import UserError
from .builder import _pooled_builder, _remove
from .database import RECORDS, _best_ms, _merge, _open_database, _read, _record_counts, _workload_key, repair_database
from .lowering import _lowered
from .runner import Boards, _measured_on, _runner
from .schedules import _cpu_default_postprocs, _cpu_default_schedule, _gpu_default_schedules
from .search import Progress, _interrupt_after_batch, _search, _Watch
from .targets import _cross_compiler, _resolve_target
from .tensor_intrin import _tensor_intrin_importer


def tune_onnx(
    models: onnx.ModelProto | Sequence[onnx.ModelProto],
    target: dict,
    tuning_db: Path,
    *,
    trials: int,
    time_budget_s: float | None = None,
    seed: int = 0,
    progress: Callable[[Progress], None] | None = None,
    log: Callable[[str], None] | None = None,
    boards: Boards | None = None,
    num_cores: int | None = None,
    transfer: bool = True,
    log_dir: Path | None = None,
    only_tasks: Sequence[str] | None = None,
    batch: int | None = None,
) -> dict:
    """Search schedules for the TIR functions of `models` (segments for one `target`).

    Needs: the target's CPU here, or a GPU here for CUDA, or `boards` (an RPC tracker with a
    free server under the key) that run the target's code.
    Guarantees: every candidate measured is appended to the database in `tuning_db` at once
    (an interrupted run loses at most the batch in flight); a workload whose finished search
    had a budget >= `trials` is not searched again; otherwise the search continues the
    records already there with what is left of `trials` (the budget over all workloads
    searched now). With `transfer`, the XGBoost cost model is trained on every record in
    the database before the first candidate is picked. The search stops at `trials`
    measured candidates, at `time_budget_s` seconds (checked after each batch), or when
    remote boards stop answering. Candidates that fail to build or run are counted and
    reported; the search goes on with the rest. Ctrl-C ends the search after the batch in
    flight and raises KeyboardInterrupt once the builders are shut down; what was measured
    stays in the database. MetaSchedule's own
    logs go to `log_dir` (a temporary directory if None), never into the database.
    `only_tasks` limits the search to the tasks of those names and `batch` fixes the number
    of candidates per measured batch (both for experiments, such as benchmarks/bench_tune.py).

    Returns a summary (JSON-ready): `tasks`, `searched`, `reused`, `trials` (candidates
    measured now), `stopped` ("budget", "time", "boards-lost", "done": nothing to search),
    `wall_s`, `transfer` (records and workloads the cost model was trained on first),
    `failures` (build / run counts and the first messages), `measured_on`, and `per_task`:
    name, weight, trials (measured now), records (in the database), untuned_ms, best_ms,
    speedup.
    """
    start = time.monotonic()
    models = [models] if isinstance(models, onnx.ModelProto) else list(models)
    summary: dict[str, Any] = {"tasks": 0, "searched": 0, "reused": 0, "trials": 0, "stopped": "done", "seed": seed,
                               "per_task": [], "failures": {"build": 0, "run": 0, "messages": []}}
    if trials <= 0:
        return summary
    say = log or (lambda s: None)
    # the target, and where its candidates are measured: on boards over RPC, or here if this host runs them
    target, tvm_target = _resolve_target(target)
    summary["measured_on"] = _measured_on(target, tvm_target, boards)
    cores, tvm_target = _with_cores(target, num_cores)
    # the tasks: the segments' fused TIR functions (lowered as compilation does), one per workload
    tasks = _extract_tasks(models, tvm_target)
    if only_tasks is not None:
        tasks = [t for t in tasks if t.name in set(only_tasks)]
    summary["tasks"] = len(tasks)
    # reuse: a task whose finished search had this budget costs no trials; the others share what is left
    path = Path(tuning_db)
    database = _open_repaired(path, target, say)
    todo, remaining = _tasks_to_search(tasks, path, database, trials)
    summary["reused"], summary["searched"] = len(tasks) - len(todo), len(todo)
    baseline, records_before = _read(path, "baseline.json"), _record_counts(database)
    # the search: the untuned baseline, the cost model's transfer, then the budgeted and timed search
    stop = {"why": "done"}
    if todo:
        stop = _tune_tasks(todo, remaining, trials, target, tvm_target, cores, path, database, baseline, summary,
                           say, boards=boards, transfer=transfer, progress=progress, log_dir=log_dir, batch=batch,
                           seed=seed, start=start, time_budget_s=time_budget_s)
    # the summary: the trials measured now, why the search stopped, and per task its records and speedup
    _summarize(summary, tasks, todo, database, baseline, records_before, stop)
    summary["wall_s"] = round(time.monotonic() - start, 2)
    return summary


def untuned_reason(models: Sequence[onnx.ModelProto], target: dict, tuning_db: Path) -> str | None:
    """Why the database in `tuning_db` does not hold tuned records for every tunable function of
    `models` (segments for `target`, lowered as compilation lowers them); None when it does.

    A function is tuned when a search of it finished (`searched.json`) or the database holds more of
    its records than the one its untuned baseline adds. An empty or missing database answers without
    importing TVM; otherwise the segments are imported and lowered (the first half of compiling them).
    """
    path = Path(tuning_db)
    if not (path / RECORDS).exists() or not (path / RECORDS).stat().st_size:
        return "the tuning database has no records"
    target, _ = _resolve_target(target)
    try:
        database = _open_database(path, target, must_exist=True)
    except UserError as e:  # a database of another target holds nothing for this one
        return e.message
    _, tvm_target = _with_cores(target, None)  # as `tune_onnx` extracts its tasks
    tasks = _extract_tasks(list(models), tvm_target)
    if not tasks:
        return "no function to tune"
    searched, counts = _read(path, "searched.json"), _record_counts(database, valid_only=True)
    untuned = [t for t in tasks if searched.get(t.key, 0) <= 0 and counts.get(t.key, 0) < 2]
    if untuned:
        return f"{len(untuned)} of {len(tasks)} functions have no tuned records (first: {untuned[0].name})"
    return None


def _with_cores(target: dict, num_cores: int | None) -> tuple[int, Any]:
    """The core count tuning assumes (`num_cores`, the target's, or this host's) and the tvm Target with it."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    cores = int(num_cores or target.get("num-cores") or ms.utils.cpu_count(logical=False))
    # MetaSchedule sizes parallel loops by the target's core count; the database keeps the
    # target as given, so that compiling for it finds these records.
    return cores, tvm.target.Target({**target, "num-cores": cores})


@dataclass
class _Task:
    name: str
    key: str  # the workload's structural hash, as the database keys it
    mod: Any  # the workload: an IRModule with one PrimFunc "main"
    weight: int  # how many times the segments call it
    extracted: Any


def _extract_tasks(models: list[onnx.ModelProto], tvm_target: Any) -> list[_Task]:
    """The tunable functions of all `models`, one per workload, weights summed over the models."""
    from tvm.s_tir import meta_schedule as ms

    merged: dict[str, _Task] = {}
    for model in models:
        for task in ms.relax_integration.extract_tasks(_lowered(model, tvm_target), tvm_target):
            if task.dispatched[0]["main"].attrs.get("tirx.is_scheduled", False):
                continue  # scheduled when lowered (the sparse kernels' layout transposes)
            key = _workload_key(task.dispatched[0])
            if key in merged:
                merged[key].weight += int(task.weight)
            else:
                merged[key] = _Task(task.task_name, key, task.dispatched[0], int(task.weight), task)
    for t in merged.values():
        t.extracted = ms.ExtractedTask(t.name, t.extracted.mod, tvm_target, [t.mod], t.weight)
    return list(merged.values())


def _open_repaired(path: Path, target: dict, say: Callable[[str], None]) -> Any:
    """The database in `path` (created if new), its last line dropped first if a write was interrupted."""
    dropped = repair_database(path)
    if dropped:
        say(f"tune: dropped {dropped} incomplete line(s) at the end of the database (an interrupted write)")
    return _open_database(path, target, must_exist=False)


def _tasks_to_search(tasks: list[_Task], path: Path, database: Any, trials: int) -> tuple[list[_Task], int]:
    """The tasks without a finished search of `trials` candidates, and what is left of the budget for them."""
    # the budget counts candidates that were measured: those lost with a board are measured again
    counts = _record_counts(database, valid_only=True)
    searched = _read(path, "searched.json")
    todo = [t for t in tasks if searched.get(t.key, 0) < trials]
    remaining = trials - sum(counts.get(t.key, 0) for t in todo)
    if todo and remaining <= 0:  # an earlier, interrupted run with this budget measured it all
        _merge(path, "searched.json", dict.fromkeys((t.key for t in todo), trials), max)
        todo = []
    return todo, remaining


def _tune_tasks(todo, remaining, trials, target, tvm_target, cores, path, database, baseline, summary, say, *,
                boards, transfer, progress, log_dir, batch, seed, start, time_budget_s) -> dict:
    """Search `todo` with `remaining` trials: the untuned baseline, transfer, the search; how it stopped."""
    from tvm.s_tir import meta_schedule as ms

    deadline = start + time_budget_s if time_budget_s else math.inf
    stop = {"why": "budget"}
    runner = _runner(ms, boards)
    builder = _pooled_builder(max(1, min(ms.utils.cpu_count(logical=False), remaining // 8)), _cross_compiler(target),
                              tvm_target.kind.name)
    try:
        # the untuned baseline: each new task's default schedule measured (on CPU, a record too)
        remaining -= _measure_baseline(todo, baseline, path, tvm_target, builder, runner, database, say)
        # transfer: the cost model trained on every record already in the database
        cost_model = _cost_model(database, tvm_target, cores, transfer, summary, say)
        # the search: batches until the budget, the time budget, Ctrl-C or lost boards end it
        if remaining > 0:  # the time budget is checked after each batch: at least one is measured
            watch = _Watch(progress, [t.name for t in todo], remaining, start, deadline, boards is not None,
                           summary["failures"], stop)
            with _interrupt_after_batch(watch, say):
                _search(ms, todo, tvm_target, log_dir, remaining, batch, seed, builder, runner, database,
                        cost_model, watch)
    finally:
        builder.shutdown()
    if stop["why"] == "interrupted":
        raise KeyboardInterrupt
    if stop["why"] == "budget":  # finished: these workloads cost no trials with this budget again
        _merge(path, "searched.json", dict.fromkeys((t.key for t in todo), trials), max)
    return stop


def _measure_baseline(todo, baseline, path, tvm_target, builder, runner, database, say) -> int:
    """The untuned latency of each task in `todo` without one yet, kept in `baseline.json`; how many were measured."""
    new = [t for t in todo if baseline.get(t.key) is None]
    if not new:
        return 0
    say(f"tune: measuring the untuned default schedule of {len(new)} task(s)")
    measured = {k: v for k, v in _measure_defaults(new, tvm_target, builder, runner, database).items()
                if v is not None}
    baseline.update(measured)
    _merge(path, "baseline.json", measured, lambda old, new_: new_)
    return len(measured)


def _measure_defaults(tasks: list[_Task], tvm_target: Any, builder, runner, database) -> dict[str, float | None]:
    """Each task's untuned schedule (what the package stage gives a function without a record)
    built and measured like a candidate. On CPU it becomes a record too, so the schedule
    applied later is never one measured slower than the default."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    gpu = "gpu" in tvm_target.keys
    jobs = []
    for t in tasks:
        func = t.mod["main"]
        sch = None
        if gpu:
            mod = _gpu_default_schedules(tvm.IRModule({"main": func}))
        else:
            try:
                sch = _cpu_default_schedule(func, tvm_target, _cpu_default_postprocs)
            except Exception:  # noqa: BLE001 -- no default schedule: TVM's plain loop nest
                sch = None
            mod = sch.mod if sch is not None else tvm.IRModule({"main": func})
        jobs.append((t, sch, mod))
    built = builder.build([ms.builder.BuilderInput(mod, tvm_target) for _, _, mod in jobs])
    args = [ms.arg_info.ArgInfo.from_prim_func(t.mod["main"]) for t, _, _ in jobs]
    futures = {}
    for i, b in enumerate(built):
        if b.error_msg is None:
            device = "cuda" if gpu else "cpu"
            futures[i] = runner.run([ms.runner.RunnerInput(b.artifact_path, device, args[i])])[0]
    out: dict[str, float | None] = {}
    for i, (t, sch, _) in enumerate(jobs):
        result = futures[i].result() if i in futures else None
        if built[i].artifact_path:
            _remove(built[i].artifact_path)
        if result is None or result.error_msg is not None or not result.run_secs:
            out[t.key] = None
            continue
        secs = [float(s) for s in result.run_secs]
        out[t.key] = round(1e3 * sum(secs) / len(secs), 6)
        if sch is not None:
            workload = database.commit_workload(t.mod)
            database.commit_tuning_record(
                ms.database.TuningRecord(sch.trace, workload, result.run_secs, tvm_target, args[i])
            )
    return out


def _cost_model(database, tvm_target, cores, transfer, summary, say) -> Any:
    """MetaSchedule's XGBoost cost model, with `transfer` first trained on every record in `database`."""
    from tvm.s_tir import meta_schedule as ms

    cost_model = ms.cost_model.XGBModel(num_tuning_cores=cores, tree_method="auto")
    if transfer and len(database):
        summary["transfer"] = _pretrain(cost_model, database, tvm_target, cores)
        say(f"tune: cost model trained on {summary['transfer']['records']} records of "
            f"{summary['transfer']['workloads']} workloads already in the database")
    return cost_model


def _pretrain(cost_model: Any, database: Any, tvm_target: Any, cores: int) -> dict:
    """Train `cost_model` on every record in `database`, grouped by workload (the model scores
    a candidate relative to the best of its own workload, so workloads mix).

    Records whose trace no longer replays (another TVM version wrote them) are skipped.
    """
    from tvm.s_tir import meta_schedule as ms

    _tensor_intrin_importer(tvm_target.kind.name)()  # before TuneContext does it the slow way
    groups: dict[str, tuple[Any, list]] = {}
    for record in database.get_all_tuning_records():
        key = _workload_key(record.workload.mod)
        groups.setdefault(key, (record.workload.mod, []))[1].append(record)
    used = 0
    for mod, records in groups.values():
        context = ms.TuneContext(mod=mod, target=tvm_target, num_threads=cores)
        candidates, results = [], []
        for record in records:
            try:
                candidates.append(record.as_measure_candidate())
            except Exception:  # noqa: BLE001
                continue
            results.append(ms.runner.RunnerResult(run_secs=record.run_secs, error_msg=None))
        if candidates:
            cost_model.update(context, candidates, results)
            used += len(candidates)
    return {"records": used, "workloads": len(groups)}


def _summarize(summary, tasks, todo, database, baseline, records_before, stop) -> None:
    """Fill `summary` with the trials measured now, why the search stopped, and each task's records and speedup."""
    after = _record_counts(database)
    summary["trials"] = sum(after.values()) - sum(records_before.values())
    summary["stopped"] = stop["why"]
    if stop.get("message"):
        summary["stop_message"] = stop["message"]
    for t in tasks:
        best, untuned = _best_ms(database, t.mod), baseline.get(t.key)
        summary["per_task"].append({
            "name": t.name, "workload": t.key, "weight": t.weight, "searched": t in todo,
            "trials": after.get(t.key, 0) - records_before.get(t.key, 0), "records": after.get(t.key, 0),
            "untuned_ms": untuned, "best_ms": best,
            "speedup": round(untuned / best, 3) if untuned and best else None,
        })
