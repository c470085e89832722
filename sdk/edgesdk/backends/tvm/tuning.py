"""MetaSchedule tuning of TVM segments: budgeted, resumable, transferable, local or remote.

    tune: the segments' fused TIR functions (`_lower`, the same as compilation's), merged
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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from ...errors import UsageError, UserError

RECORDS = "database_tuning_record.json"
WORKLOADS = "database_workload.json"
# A measured batch whose candidates all fail to run, this many times in a row, on remote boards:
# the boards are gone, and the search stops instead of burning its budget on failures.
_LOST_BOARD_BATCHES = 2
_BUILD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Boards:
    """Boards registered with a TVM RPC tracker under `key`, which measure the candidates."""

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


@dataclass
class Progress:
    """The search so far, after each measured batch."""

    measured: int  # candidates measured by this run
    budget: int
    elapsed_s: float
    task: str  # the task whose batch was just measured
    best_ms: dict[str, float] = field(default_factory=dict)  # task name -> best latency so far
    failed: int = 0  # candidates that failed to build or run


# --- the search ------------------------------------------------------------------------


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
    from . import _cross_compiler, _resolve_target

    start = time.monotonic()
    models = [models] if isinstance(models, onnx.ModelProto) else list(models)
    summary: dict[str, Any] = {"tasks": 0, "searched": 0, "reused": 0, "trials": 0, "stopped": "done", "seed": seed,
                               "per_task": [], "failures": {"build": 0, "run": 0, "messages": []}}
    if trials <= 0:
        return summary
    import tvm
    from tvm.s_tir import meta_schedule as ms

    say = log or (lambda s: None)
    target, tvm_target = _resolve_target(target)
    if boards is not None:
        servers = check_boards(boards)
        summary["measured_on"] = f"{servers} board(s) {boards}"
    else:
        _check_measurable(target, tvm_target)
        summary["measured_on"] = "this host"
    cores = num_cores or target.get("num-cores") or ms.utils.cpu_count(logical=False)
    # MetaSchedule sizes parallel loops by the target's core count; the database keeps the
    # target as given, so that compiling for it finds these records.
    tvm_target = tvm.target.Target({**target, "num-cores": int(cores)})
    tasks = _extract_tasks(models, tvm_target)
    if only_tasks is not None:
        tasks = [t for t in tasks if t.name in set(only_tasks)]
    summary["tasks"] = len(tasks)
    path = Path(tuning_db)
    dropped = repair_database(path)
    if dropped:
        say(f"tune: dropped {dropped} incomplete line(s) at the end of the database (an interrupted write)")
    database = _open(path, target)
    # the budget counts candidates that were measured: those lost with a board are measured again
    counts = _record_counts(database, valid_only=True)
    searched, baseline = _read(path, "searched.json"), _read(path, "baseline.json")
    todo = [t for t in tasks if searched.get(t.key, 0) < trials]
    remaining = trials - sum(counts.get(t.key, 0) for t in todo)
    if todo and remaining <= 0:  # an earlier, interrupted run with this budget measured it all
        _merge(path, "searched.json", dict.fromkeys((t.key for t in todo), trials), max)
        todo = []
    summary["reused"], summary["searched"] = len(tasks) - len(todo), len(todo)
    records_before = _record_counts(database)
    deadline = start + time_budget_s if time_budget_s else math.inf
    stop = {"why": "budget" if todo else "done"}
    if todo:
        runner = _runner(ms, boards)
        builder = _pooled_builder(max(1, min(ms.utils.cpu_count(logical=False), remaining // 8)),
                                  _cross_compiler(target))
        try:
            new = [t for t in todo if baseline.get(t.key) is None]
            if new:
                say(f"tune: measuring the untuned default schedule of {len(new)} task(s)")
                measured = {k: v for k, v in _measure_defaults(new, tvm_target, builder, runner, database).items()
                            if v is not None}
                baseline.update(measured)
                _merge(path, "baseline.json", measured, lambda old, new_: new_)
                remaining -= len(measured)
            cost_model = ms.cost_model.XGBModel(num_tuning_cores=int(cores), tree_method="auto")
            if transfer and len(database):
                summary["transfer"] = _pretrain(cost_model, database, tvm_target, int(cores))
                say(f"tune: cost model trained on {summary['transfer']['records']} records of "
                    f"{summary['transfer']['workloads']} workloads already in the database")
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
    summary["wall_s"] = round(time.monotonic() - start, 2)
    return summary


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

    from . import _import, _lower

    merged: dict[str, _Task] = {}
    for model in models:
        for task in ms.relax_integration.extract_tasks(_lower(_import(model), tvm_target), tvm_target):
            key = _workload_key(task.dispatched[0])
            if key in merged:
                merged[key].weight += int(task.weight)
            else:
                merged[key] = _Task(task.task_name, key, task.dispatched[0], int(task.weight), task)
    for t in merged.values():
        t.extracted = ms.ExtractedTask(t.name, t.extracted.mod, tvm_target, [t.mod], t.weight)
    return list(merged.values())


def _search(ms, todo, tvm_target, log_dir, budget, batch, seed, builder, runner, database, cost_model, watch) -> None:
    """MetaSchedule's gradient-based task scheduler over `todo`, at most `budget` candidates."""
    import logging
    import tempfile

    from . import _tensor_intrin_importer

    # One measured batch must not overshoot a small budget, and MetaSchedule's scheduler first
    # gives every task one batch: batches small enough that each task gets about two of them.
    batch = min(budget, batch or max(1, min(64, max(8, budget // (2 * len(todo))))))
    # The population the cost model ranks to pick each batch: 16 candidates per slot keeps the
    # batch diverse; TVM's fixed 512 costs seconds per round on small budgets.
    strategy = ms.search_strategy.EvolutionarySearch(population_size=min(512, max(64, 16 * batch)))
    _tensor_intrin_importer()()  # before TuneContext does it the slow way
    _drop_unnamed_handlers("tvm.s_tir.meta_schedule")
    # MetaSchedule's console handler takes the logger's level (DEBUG when unset) and writes
    # to stdout, where `edgesdk build --json` prints its summary: warnings only, progress is ours.
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="edgesdk-tune-logs-"))
        work_dir = str(log_dir)
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            [t.extracted for t in todo], work_dir=work_dir, strategy=strategy, seed=seed
        )
        try:
            ms.tune_tasks(
                tasks=contexts,
                task_weights=weights,
                work_dir=work_dir,
                max_trials_global=budget,
                max_trials_per_task=budget,
                num_trials_per_iter=batch,
                builder=builder,
                runner=runner,
                database=database,
                cost_model=cost_model,
                measure_callbacks=[*ms.MeasureCallback.create("default"), watch.callback()],
            )
        except Exception:
            if watch.stop.get("why") in ("time", "boards-lost", "interrupted"):
                return  # `_Watch._end` left the loop on purpose
            raise


class _Watch:
    """After each measured batch: progress, failure accounting, the time budget, lost boards."""

    def __init__(self, progress, names, budget, start, deadline, remote, failures, stop) -> None:
        self.progress, self.names, self.budget = progress, names, budget
        self.start, self.deadline, self.remote = start, deadline, remote
        self.failures, self.stop = failures, stop
        self.measured, self.failed_batches = 0, 0
        self.best: dict[str, float] = {}
        self.interrupted = False  # set by Ctrl-C (`_interrupt_after_batch`)

    def callback(self) -> Any:
        from tvm.ir.utils import derived_object
        from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

        watch = self

        @derived_object
        class _Callback(PyMeasureCallback):
            def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
                watch.apply(task_id, builder_results, runner_results)

        return _Callback()

    def apply(self, task_id, builder_results, runner_results) -> None:
        name = self.names[task_id]
        ran = 0
        for built, result in zip(builder_results, runner_results):
            if built.error_msg is not None:
                self._fail("build", name, built.error_msg)
            elif result.error_msg is not None:
                self._fail("run", name, result.error_msg)
            elif result.run_secs:
                ran += 1
                ms_ = 1e3 * sum(float(s) for s in result.run_secs) / len(result.run_secs)
                self.best[name] = min(self.best.get(name, math.inf), ms_)
        self.measured += len(runner_results)
        self.failed_batches = 0 if ran or not runner_results else self.failed_batches + 1
        if self.progress is not None:
            failed = self.failures["build"] + self.failures["run"]
            self.progress(Progress(self.measured, self.budget, time.monotonic() - self.start, name,
                                   dict(self.best), failed))
        if self.interrupted:
            self._end("interrupted", "")
        elif self.remote and self.failed_batches >= _LOST_BOARD_BATCHES:
            self._end("boards-lost",
                      f"the last {self.failed_batches} batches all failed to run on the boards "
                      f"({self.failures['messages'][-1] if self.failures['messages'] else 'no message'})")
        elif time.monotonic() >= self.deadline:
            self._end("time", "")

    def _fail(self, kind: str, task: str, message: str) -> None:
        self.failures[kind] += 1
        if len(self.failures["messages"]) < 5:
            self.failures["messages"].append(f"{kind} of a {task} candidate: {_gist(message)}")

    def _end(self, why: str, message: str) -> None:
        """Stop the search now. The batch just measured is already in the database (MetaSchedule's
        own callbacks ran before this one). Marking the tasks terminated from here trips the
        scheduler's own checks, so the search is left by an exception that `_search` expects."""
        self.stop["why"] = why
        if message:
            self.stop["message"] = message
        raise _SearchEnded(why)


class _SearchEnded(Exception):
    """Raised from the measure callback to leave MetaSchedule's loop (it reaches `_search` as a
    RuntimeError carrying this message, through TVM's C++ frames)."""


@contextlib.contextmanager
def _interrupt_after_batch(watch: _Watch, say: Callable[[str], None]):
    """Ctrl-C during the search ends it after the batch in flight, whose records are then in the
    database (a KeyboardInterrupt raised inside MetaSchedule's C++ loop would reach us as a bare
    RuntimeError, with the batch lost); a second Ctrl-C interrupts at once."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(signum, frame):
        watch.interrupted = True
        say("tune: interrupted: stopping after the batch being measured (Ctrl-C again to stop now)")
        signal.signal(signal.SIGINT, previous)

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _gist(message: str) -> str:
    """The line of an error (often a whole remote traceback) that says what went wrong."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    said = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("error")]
    return (said[-1] if said else lines[-1] if lines else "no message")[:300]


# --- untuned baseline and transfer ----------------------------------------------------


def _measure_defaults(tasks: list[_Task], tvm_target: Any, builder, runner, database) -> dict[str, float | None]:
    """Each task's untuned schedule (what the package stage gives a function without a record)
    built and measured like a candidate. On CPU it becomes a record too, so the schedule
    applied later is never one measured slower than the default."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from . import _cpu_default_postprocs, _cpu_default_sch, _gpu_default_schedules

    gpu = "gpu" in tvm_target.keys
    jobs = []
    for t in tasks:
        func = t.mod["main"]
        sch = None
        if gpu:
            mod = _gpu_default_schedules(tvm.IRModule({"main": func}))
        else:
            try:
                sch = _cpu_default_sch(func, tvm_target, _cpu_default_postprocs)
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


def _pretrain(cost_model: Any, database: Any, tvm_target: Any, cores: int) -> dict:
    """Train `cost_model` on every record in `database`, grouped by workload (the model scores
    a candidate relative to the best of its own workload, so workloads mix).

    Records whose trace no longer replays (another TVM version wrote them) are skipped.
    """
    from tvm.s_tir import meta_schedule as ms

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


# --- measurement: local or remote -----------------------------------------------------


def _evaluator(ms) -> Any:
    # TVM's defaults: 3 runs per repeat, repeats of at least 100 ms, caches not flushed
    return ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=100, enable_cpu_cache_flush=False)


def _runner(ms, boards: Boards | None) -> Any:
    if boards is None:
        return ms.runner.LocalRunner(timeout_sec=30, evaluator_config=_evaluator(ms))
    from tvm.support.popen_pool import PopenPoolExecutor

    workers = max(1, _servers(boards))  # a fleet measures in parallel, one candidate per board
    runner = ms.runner.RPCRunner(
        rpc_config=ms.runner.RPCConfig(
            tracker_host=boards.host, tracker_port=boards.port, tracker_key=boards.key,
            session_priority=1, session_timeout_sec=int(boards.session_timeout_s),
        ),
        evaluator_config=_evaluator(ms),
        max_workers=workers,
        f_create_session=_session_factory(),
    )
    # TVM's runner waits for a candidate without end; a board that hangs costs one timeout
    runner.pool = PopenPoolExecutor(max_workers=workers, timeout=2 * boards.session_timeout_s)
    return runner


def _session_factory() -> Callable[[Any], Any]:
    """The RPC runner's session opener, which fails at once where TVM's would wait forever.

    TVM's asks the tracker for a server of the key and blocks until one is free; when the
    boards are gone (killed, unplugged, powered off), that is never, and the search hangs.
    This one first asks the tracker whether any server of the key is registered, and fails
    the candidate if none is. Built nested, so that cloudpickle ships it to the runner's
    worker processes by value.
    """

    def create_session(rpc_config):
        import socket

        from tvm import rpc

        host, port, key = rpc_config.tracker_host, rpc_config.tracker_port, rpc_config.tracker_key
        socket.create_connection((host, port), timeout=5).close()
        tracker = rpc.connect_tracker(host, port)
        tracker._sock.settimeout(rpc_config.session_timeout_sec)
        summary = tracker.summary()
        if not any(s.get("key") == "server:" + key for s in summary.get("server_info", [])):
            tracker.close()
            raise RuntimeError(f"no board is registered with the tracker {host}:{port} under the key {key!r}")
        return tracker.request(key, priority=rpc_config.session_priority,
                               session_timeout=rpc_config.session_timeout_sec, max_retry=1)

    return create_session


def check_boards(boards: Boards, timeout_s: float = 5.0) -> int:
    """The number of servers registered under the key. A tracker that does not answer, or a
    key no board registered, is a user error."""
    try:
        with socket.create_connection((boards.host, boards.port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise UserError(
            "tune.rpc-tracker",
            f"the RPC tracker at {boards.host}:{boards.port} does not answer ({exc.strerror or exc})",
            hint="start it with `python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port PORT`, "
                 "or check --rpc-tracker",
        ) from exc
    servers = _servers(boards, timeout_s)
    if servers == 0:
        raise UserError(
            "tune.rpc-no-board",
            f"no board is registered with the tracker {boards.host}:{boards.port} under the key {boards.key!r}",
            hint="start `python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY` on each board, "
                 "or check --rpc-key",
        )
    return servers


def _servers(boards: Boards, timeout_s: float = 5.0) -> int:
    """Servers registered under the key (free or busy), from the tracker's summary."""
    from tvm import rpc

    try:
        tracker = rpc.connect_tracker(boards.host, boards.port)
        tracker._sock.settimeout(timeout_s)  # a peer that is not a tracker never answers
        try:
            summary = tracker.summary()
        finally:
            tracker.close()
    except Exception as exc:  # noqa: BLE001 -- an answer that is not a tracker's
        raise UserError(
            "tune.rpc-tracker",
            f"{boards.host}:{boards.port} answers, but not as a TVM RPC tracker ({exc})",
            hint="point --rpc-tracker at `python -m tvm.exec.rpc_tracker`",
        ) from exc
    return sum(1 for s in summary.get("server_info", []) if s.get("key") == "server:" + boards.key)


def _check_measurable(target: dict, tvm_target: Any) -> None:
    """Tuning measures candidates on this machine: it must be able to run them."""
    import platform

    import tvm

    from . import _ARCHES, missing_host_features, target_arch

    if tvm_target.kind.name == "cuda" and not tvm.cuda(0).exist:
        raise UserError(
            "tvm.tune-needs-gpu",
            "tuning a cuda segment measures kernels on a GPU, and this machine has none",
            hint="tune on the GPU host, or measure on it over RPC (--rpc-tracker), or build with --trials 0",
        )
    host = _ARCHES.get(platform.machine().lower())
    if tvm_target.kind.name == "llvm" and target_arch(target) != host:
        raise UserError(
            "tvm.tune-foreign-cpu",
            f"tuning for {target_arch(target)} measures kernels on that cpu, and this host is {host}",
            hint="measure on the boards over RPC (--rpc-tracker HOST:PORT --rpc-key KEY), or build with --trials 0",
        )
    missing = missing_host_features(target) if tvm_target.kind.name == "llvm" else []
    if missing:
        raise UserError(
            "tvm.tune-foreign-cpu",
            f"tuning measures kernels on this host, and code for cpu {target.get('mcpu', 'generic')} uses "
            f"{', '.join(missing)}, which this host's cpu lacks (it would die with SIGILL)",
            hint="tune on a host with that cpu or on one over RPC (--rpc-tracker), set mcpu to native, "
                 "or build with --trials 0",
        )


# --- building candidates -------------------------------------------------------------


def _build_job(mod: Any, target: Any, params: Any, compiler: str | None) -> str:
    """Build one candidate into a shared library, linked by `compiler` when the target's CPU is
    not this host's. Runs in a builder worker process; a library, not TVM's default .tar, so
    that a board needs no compiler."""
    import tempfile

    import tvm
    from tvm import s_tir
    from tvm.support import cc

    from . import _runs_every_instance

    try:
        sound = _runs_every_instance(s_tir.Schedule(mod))
    except Exception:  # noqa: BLE001 -- not a block-structured function: the build decides
        sound = True
    if not sound:
        # TVM 0.27 can leave a fused padding's border unwritten: fast and wrong (see _apply_database)
        raise RuntimeError("the candidate does not run every instance of a block (TVM 0.27 leaves part "
                           "of a fused epilogue unwritten): refused")
    with target:  # the relax VM-free build MetaSchedule does: the function alone
        lib = tvm.compile(mod, target=target)
    path = os.path.join(tempfile.mkdtemp(prefix="edgesdk-tune-"), "candidate.so")
    lib.export_library(path, **({"fcompile": cc.cross_compiler(compiler)} if compiler else {}))
    return path


def _build_jobs(build_inputs: list) -> list[tuple]:
    """What each builder worker gets (a seam for tests that inject a failing candidate)."""
    return [(b.mod, b.target, None) for b in build_inputs]


def _pooled_builder(max_workers: int, compiler: str | None) -> Any:
    """A MetaSchedule builder whose worker processes live as long as the tuning run; libraries
    are linked by `compiler` (`_cross_compiler`; None: this host's).

    TVM's LocalBuilder starts fresh workers for every measured batch, and each worker's
    first build imports `tvm.s_tir.tensor_intrin` (see `_tensor_intrin_importer`). These
    workers import it once per tuning run, while the tuning process prepares the search.
    A candidate that fails or times out gets its error message; the others are built.
    """
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    from . import _tensor_intrin_importer

    @derived_object
    class _PooledBuilder(PyBuilder):
        def __init__(self) -> None:
            super().__init__()
            self.pool = PopenPoolExecutor(
                max_workers=max_workers, timeout=_BUILD_TIMEOUT_S, initializer=_tensor_intrin_importer()
            )
            for _ in range(max_workers):  # start the workers now: their import overlaps ours
                self.pool.submit(int)

        def build(self, build_inputs):
            results = []
            for result in self.pool.map_with_error_catching(lambda job: _build_job(*job, compiler),
                                                           _build_jobs(build_inputs)):
                if result.status == StatusKind.COMPLETE:
                    results.append(BuilderResult(result.value, None))
                elif result.status == StatusKind.TIMEOUT:
                    results.append(BuilderResult(None, f"build timed out after {_BUILD_TIMEOUT_S:g} s"))
                else:
                    results.append(BuilderResult(None, f"build failed: {result.value}"))
            return results

        def shutdown(self) -> None:
            self.pool.shutdown()

    return _PooledBuilder()


def _remove(path: str) -> None:
    import shutil

    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


# --- the database --------------------------------------------------------------------


def _open(path: Path, target: dict) -> Any:
    from . import _open_database

    return _open_database(path, target, must_exist=False)


def repair_database(path: Path) -> int:
    """Drop an incomplete last line from the database's JSON-lines files (a write cut short by
    a killed process); returns how many lines were dropped. A bad line anywhere else is not
    ours to guess about: a user error naming the file and line."""
    dropped = 0
    for name in (WORKLOADS, RECORDS):
        file = path / name
        if not file.exists():
            continue
        lines = file.read_bytes().split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # after the last newline: "" when the file is whole
        bad = [i for i, line in enumerate(complete) if line.strip() and not _parses(line)]
        if bad and bad != [len(complete) - 1]:
            raise UserError(
                "tune.db-corrupt",
                f"tuning database file {file}, line {bad[0] + 1}, is not a JSON record",
                hint="restore the database from a copy (each build keeps one in build/tune/tuning_db), "
                     "or delete the file to start over",
            )
        if bad or tail.strip():
            keep = complete[:-1] if bad else complete
            dropped += len(bad) + (1 if tail.strip() else 0)
            tmp = file.with_suffix(".json.tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in keep))
            os.replace(tmp, file)
    return dropped


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _workload_key(mod: Any) -> str:
    from tvm.s_tir.meta_schedule.utils import shash2hex

    return shash2hex(mod)


def _record_counts(database: Any, *, valid_only: bool = False) -> dict[str, int]:
    """Records per workload structural hash; with `valid_only`, those of candidates that ran
    (MetaSchedule records a failed build or run with a latency of 1e10 s)."""
    counts: dict[str, int] = {}
    for record in database.get_all_tuning_records():
        if valid_only and (not record.run_secs or min(float(s) for s in record.run_secs) >= 1e9):
            continue
        key = _workload_key(record.workload.mod)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _best_ms(database: Any, mod: Any) -> float | None:
    if not database.has_workload(mod):
        return None
    top = database.get_top_k(database.commit_workload(mod), 1)
    if not top or not top[0].run_secs:
        return None
    secs = [float(s) for s in top[0].run_secs]
    return round(1e3 * sum(secs) / len(secs), 6)


def _read(path: Path, name: str) -> dict:
    file = path / name
    return json.loads(file.read_text()) if file.exists() else {}


def _merge(path: Path, name: str, values: dict, combine: Callable[[Any, Any], Any]) -> None:
    """Merge `values` into the JSON object in `path/name`, written atomically."""
    merged = _read(path, name)
    for key, value in values.items():
        merged[key] = combine(merged[key], value) if key in merged else value
    tmp = path / (name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / name)


def _drop_unnamed_handlers(logger_name: str) -> None:
    """MetaSchedule rebuilds its loggers with logging.config.dictConfig, naming each handler the
    logger already has; a handler someone else attached without a name (a test harness's, an
    application's) makes that crash with `'NoneType' object has no attribute 'format'`."""
    import logging

    logger = logging.getLogger(logger_name)
    for handler in list(logger.handlers):
        if handler.get_name() is None:
            logger.removeHandler(handler)
