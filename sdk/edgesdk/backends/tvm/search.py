"""The search: MetaSchedule's task scheduler over the tasks left to tune, watched after each measured
batch (progress, failures, the time budget, lost boards, Ctrl-C)."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .tensor_intrin import _tensor_intrin_importer


# A measured batch whose candidates all fail to run, this many times in a row, on remote boards:
# the boards are gone, and the search stops instead of burning its budget on failures.
_LOST_BOARD_BATCHES = 2


@dataclass
class Progress:
    """The search so far, after each measured batch."""

    measured: int  # candidates measured by this run
    budget: int
    elapsed_s: float
    task: str  # the task whose batch was just measured
    best_ms: dict[str, float] = field(default_factory=dict)  # task name -> best latency so far
    failed: int = 0  # candidates that failed to build or run


def _search(ms, todo, tvm_target, log_dir, budget, batch, seed, builder, runner, database, cost_model, watch) -> None:
    """MetaSchedule's gradient-based task scheduler over `todo`, at most `budget` candidates."""
    # One measured batch must not overshoot a small budget, and MetaSchedule's scheduler first
    # gives every task one batch: batches small enough that each task gets about two of them.
    batch = min(budget, batch or max(1, min(64, max(8, budget // (2 * len(todo))))))
    strategy = ms.search_strategy.EvolutionarySearch(**_evolution(cost_model, budget, batch))
    _tensor_intrin_importer(tvm_target.kind.name)()  # before TuneContext does it the slow way
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


def _evolution(cost_model: Any, budget: int, batch: int) -> dict[str, int]:
    """The evolutionary search's settings for a search of `budget` candidates in batches of `batch`.

    The population the cost model ranks to pick each batch: 16 candidates per slot keeps the batch diverse;
    TVM's fixed 512 costs seconds per round on small budgets. But MetaSchedule's XGBoost model scores every
    candidate at random until it has trained on `num_warmup_samples` records (100): a search that ends before
    then (the records it was trained on first, `transfer`, and the budget, fewer) ranks by chance throughout,
    and its genetic rounds (4 of mutation and ranking per batch) and a large random population only cost
    time, half of each batch's on a 4-candidate batch of one convolution. There each batch is drawn from a
    random population of twice its size."""
    warmup = getattr(cost_model, "num_warmup_samples", 0)
    if getattr(cost_model, "data_size", 0) + budget < warmup:
        return {"population_size": 2 * batch, "init_min_unmeasured": batch, "genetic_num_iters": 0}
    return {"population_size": min(512, max(64, 16 * batch))}


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


def _drop_unnamed_handlers(logger_name: str) -> None:
    """MetaSchedule rebuilds its loggers with logging.config.dictConfig, naming each handler the
    logger already has; a handler someone else attached without a name (a test harness's, an
    application's) makes that crash with `'NoneType' object has no attribute 'format'`."""
    logger = logging.getLogger(logger_name)
    for handler in list(logger.handlers):
        if handler.get_name() is None:
            logger.removeHandler(handler)
