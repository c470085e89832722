"""MetaSchedule tuning (backends/tvm/tuning.py), measured on this host: the untuned baseline,
records applied by compilation, reuse, resumption after an interrupt and a time budget,
transfer to the cost model, failing candidates, and a database cut short by a killed write.

Remote measurement over TVM RPC is in tests/backends/test_tvm_rpc.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import numpy as np
import pytest

from edgesdk.backends import tvm as tvm_backend
from edgesdk.backends.tvm import builder, targets, tuning
from edgesdk.errors import UserError
from tests.backends.test_tvm import AARCH64, HOST, assert_matches_ort, conv_graph, single_task_graph

pytestmark = pytest.mark.slow  # MetaSchedule searches

RECORDS = "database_tuning_record.json"


def _lines(db) -> list[str]:
    return [line for line in (db / RECORDS).read_text().splitlines() if line.strip()]


class _Interrupt:
    """A progress callback that presses Ctrl-C (SIGINT to this process) after `after` batches."""

    def __init__(self, after: int) -> None:
        self.after, self.seen = after, []

    def __call__(self, p) -> None:
        self.seen.append(p)
        if len(self.seen) == self.after:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """One workload tuned for a budget of 12 candidates in batches of 4, in three sittings: interrupted after
    its first batch, stopped by a time budget after one more, then finished; then asked again."""
    db = tmp_path_factory.mktemp("tuning") / "db"
    model = single_task_graph()
    interrupt = _Interrupt(after=1)
    with pytest.raises(KeyboardInterrupt):
        tvm_backend.tune_onnx(model, HOST, db, trials=12, batch=4, progress=interrupt)
    after_interrupt = len(_lines(db))
    timed = tvm_backend.tune_onnx(model, HOST, db, trials=12, batch=4, time_budget_s=1e-3)
    after_time = len(_lines(db))
    finished = tvm_backend.tune_onnx(model, HOST, db, trials=12, batch=4)
    again = tvm_backend.tune_onnx(model, HOST, db, trials=12, batch=4)
    return {"db": db, "model": model, "interrupt": interrupt, "after_interrupt": after_interrupt, "timed": timed,
            "after_time": after_time, "finished": finished, "again": again}


def test_an_interrupted_search_keeps_what_it_measured(resumed):
    # the untuned baseline (a record) and the first batch of 4 were in the database when Ctrl-C came
    assert resumed["interrupt"].seen[0].measured == 4
    assert resumed["after_interrupt"] == 1 + 4
    for line in _lines(resumed["db"]):
        json.loads(line)  # every line a whole record


def test_a_time_budget_stops_after_the_batch_and_the_next_run_resumes(resumed):
    timed, finished = resumed["timed"], resumed["finished"]
    assert timed["stopped"] == "time" and timed["trials"] == 4
    assert resumed["after_time"] == 1 + 8
    # the budget is 12 records in all: the third sitting measures only what is left
    assert finished["stopped"] == "budget" and finished["trials"] == 12 - 9
    assert len(_lines(resumed["db"])) == 12
    # the baseline was measured once, in the first sitting, and the summary still has it
    (task,) = finished["per_task"]
    assert task["untuned_ms"] > 0 and task["best_ms"] > 0 and task["records"] == 12
    assert task["best_ms"] <= task["untuned_ms"]  # the baseline is a record: the best is never worse
    assert task["speedup"] == pytest.approx(task["untuned_ms"] / task["best_ms"], rel=1e-2)


def test_a_finished_workload_costs_no_trials(resumed):
    again = resumed["again"]
    assert (again["searched"], again["reused"], again["trials"], again["stopped"]) == (0, 1, 0, "done")
    assert again["per_task"][0]["best_ms"] == resumed["finished"]["per_task"][0]["best_ms"]
    # a larger budget searches it again
    assert json.loads((resumed["db"] / "searched.json").read_text()) == {again["per_task"][0]["workload"]: 12}


def test_compilation_applies_the_records(resumed, tmp_path):
    model, db = resumed["model"], resumed["db"]
    before = tvm_backend.compile_onnx(model, HOST, tmp_path / "untuned.so")
    after = tvm_backend.compile_onnx(model, HOST, tmp_path / "tuned.so", tuning_db=db)
    assert (before.tuned, after.tasks, after.tuned) == (0, 1, 1)
    assert_matches_ort(model, tmp_path / "tuned.so", after)
    other_target = dict(HOST, mcpu="x86-64")
    with pytest.raises(UserError) as err:
        tvm_backend.compile_onnx(model, other_target, tmp_path / "x.so", tuning_db=db)
    assert err.value.code == "tvm.tuning-db-target"


def test_the_database_says_whether_a_segments_functions_are_tuned(resumed, tmp_path):
    """What the tune stage's policy asks where it cannot time the target's CPU: every function of
    these segments searched (None), or why not."""
    model, db = resumed["model"], resumed["db"]
    assert tuning.untuned_reason([model], HOST, db) is None
    # the conv graph's functions were never searched: all but the tuned one are named
    found = re.fullmatch(r"(\d+) of (\d+) functions have no tuned records \(first: .+\)",
                         tuning.untuned_reason([model, conv_graph()], HOST, db) or "")
    assert found and int(found[2]) == int(found[1]) + 1 >= 2, found
    assert tuning.untuned_reason([model], HOST, tmp_path / "empty") == "the tuning database has no records"
    assert "holds records for target" in tuning.untuned_reason([model], dict(HOST, mcpu="x86-64"), db)


def test_transfer_trains_the_cost_model_on_the_database_first(resumed, tmp_path):
    """A new workload in a database that holds another's records: the XGBoost model is trained on
    all of them before the first candidate of the new one is picked."""
    db = tmp_path / "db"
    shutil.copytree(resumed["db"], db)
    held = len(_lines(db))
    other = single_task_graph(channels=16)
    summary = tvm_backend.tune_onnx(other, HOST, db, trials=4, batch=4)
    # the database's records and the new workload's untuned baseline, measured before the search
    assert summary["transfer"] == {"records": held + 1, "workloads": 2}
    assert (summary["searched"], summary["reused"], summary["trials"]) == (1, 0, 4)
    cold = tvm_backend.tune_onnx(other, HOST, tmp_path / "cold", trials=4, batch=4, transfer=False)
    assert "transfer" not in cold


def _gpu_threads_on_a_cpu():
    from tvm.script import tirx as T

    @T.prim_func
    def f(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in T.thread_binding(64, thread="threadIdx.x"):
            b[i] = a[i] + 1.0

    return f


def test_a_candidate_that_fails_to_build_is_reported_and_the_search_goes_on(monkeypatch, tmp_path):
    """Every third candidate of the search is swapped for a function bound to GPU threads, which
    TVM's LLVM code generator really refuses to build; the others are built and measured, and the
    database stays readable."""
    real = builder._build_jobs
    calls = {"batches": 0, "n": 0}

    def jobs(build_inputs):
        import tvm

        calls["batches"] += 1
        if calls["batches"] == 1:  # the untuned baseline
            return real(build_inputs)
        out = []
        for mod, target, params in real(build_inputs):
            calls["n"] += 1
            if calls["n"] % 3 == 0:
                mod = tvm.IRModule({"main": _gpu_threads_on_a_cpu()})
            out.append((mod, target, params))
        return out

    monkeypatch.setattr(builder, "_build_jobs", jobs)
    db = tmp_path / "db"
    summary = tvm_backend.tune_onnx(single_task_graph(), HOST, db, trials=16, batch=8)
    failures = summary["failures"]
    assert failures["build"] >= 4 and failures["run"] == 0, failures
    assert failures["messages"][0].startswith("build of a fused_conv2d"), failures
    assert "InternalError" in failures["messages"][0], failures
    assert summary["stopped"] == "budget" and summary["per_task"][0]["best_ms"] > 0
    valid = [r for r in (json.loads(line)[1] for line in _lines(db)) if r[1] and min(r[1]) < 1e9]
    assert len(valid) >= 16 - failures["build"]


def test_an_incomplete_last_line_is_dropped_and_a_bad_line_elsewhere_refused(resumed, tmp_path):
    db = tmp_path / "db"
    shutil.copytree(resumed["db"], db)
    whole = (db / RECORDS).read_bytes()
    (db / RECORDS).write_bytes(whole + whole.splitlines()[0][:40])  # a write cut short
    assert tuning.repair_database(db) == 1
    assert (db / RECORDS).read_bytes() == whole
    again = tvm_backend.tune_onnx(resumed["model"], HOST, db, trials=12)
    assert again["trials"] == 0  # the database reads as before

    lines = whole.splitlines()
    (db / RECORDS).write_bytes(b"\n".join([lines[0], b"{not json", *lines[1:]]) + b"\n")
    with pytest.raises(UserError) as err:
        tuning.repair_database(db)
    assert err.value.code == "tune.db-corrupt" and f"{RECORDS}, line 2" in err.value.message


def test_tuning_needs_a_machine_that_runs_the_code(tmp_path):
    assert tvm_backend.tune_onnx(single_task_graph(), HOST, tmp_path / "db", trials=0)["trials"] == 0
    assert not (tmp_path / "db").exists()  # trials == 0 does nothing
    with pytest.raises(UserError) as err:
        tvm_backend.tune_onnx(single_task_graph(AARCH64), AARCH64, tmp_path / "db", trials=8)
    assert err.value.code == "tvm.tune-foreign-cpu" and "--rpc-tracker" in err.value.hint


def test_tuning_refuses_code_this_cpu_cannot_run(monkeypatch, tmp_path):
    """On a host without AVX-512 (here a Zen 3's features, faked), tuning for znver4 would measure
    candidates that die with SIGILL: refused before anything is built."""
    import tvm
    from tvm.target import codegen

    real = tvm_backend._host_features()
    zen3 = set(codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})))
    monkeypatch.setattr(targets, "_host_features", lambda: {f: f in zen3 for f in real})
    with pytest.raises(UserError) as err:
        tvm_backend.tune_onnx(single_task_graph(), {"kind": "llvm", "mcpu": "znver4"}, tmp_path / "db", trials=8)
    assert err.value.code == "tvm.tune-foreign-cpu" and "avx512f" in err.value.message
    assert "SIGILL" in err.value.message and "native" in err.value.hint
    assert not (tmp_path / "db").exists()


def test_progress_reports_each_batch_with_the_best_so_far(resumed):
    (p,) = resumed["interrupt"].seen
    assert p.budget == 12 - 1 and p.measured == 4 and p.failed == 0
    (name, best), = p.best_ms.items()
    assert name.startswith("fused_conv2d") and 0 < best < 100
    assert np.isfinite(p.elapsed_s)


def test_a_search_that_ends_in_the_cost_models_warm_up_picks_at_random_without_evolving():
    """MetaSchedule's XGBoost model scores at random until it has `num_warmup_samples` records: a search that
    ends before then skips the genetic rounds; one that gets past it (here with the records transfer trained
    it on first) keeps them and the larger population."""
    from tvm.s_tir import meta_schedule as ms

    from edgesdk.backends.tvm.search import _evolution

    model = ms.cost_model.XGBModel(num_tuning_cores=1)
    assert model.num_warmup_samples == 100 and model.data_size == 0
    assert _evolution(model, budget=12, batch=4) == {"population_size": 8, "init_min_unmeasured": 4,
                                                      "genetic_num_iters": 0}
    model.data_size = 95  # as after transfer from a database of 95 records
    assert _evolution(model, budget=12, batch=4) == {"population_size": 64}
    model.data_size = 0
    assert _evolution(model, budget=2000, batch=64) == {"population_size": 512}
