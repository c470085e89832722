"""Runs of a model's nodes timed on CPU backends for `edgesdk calibrate` (scheduling/backend_timing.py).

The timing is a FAKE TIMER (timings never go into tests): `timing.runner.measure_alone` is replaced by one
that says how long each run took. The runs themselves are real: cut from the model, compiled by their
backends, run by the runtime's runners and checked against onnxruntime; a run a backend cannot lower,
or whose outputs disagree, is not timed and says why.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from edgesdk import backends, timing
from edgesdk.backends import Backend
from edgesdk.config import load_target
from edgesdk.scheduling import backend_timing
from tests.scheduling.test_selection import _model

RUNS = (range(0, 3), range(0, 1), range(1, 3))  # whole; mm1; relu + mm2


def _fake_timer(monkeypatch, fail: str | None = None):
    """Run k of RUNS takes k + 1 ms on every backend, and 10 ms more in any round but the second (another
    process on the cores); the run whose directory is `fail` dies."""
    asked: list[str] = []

    def measure_alone(bundle, feeds, *, warmup=timing.WARMUP, runs=timing.RUNS):
        asked.append(bundle.name)
        if bundle.name == fail:
            raise RuntimeError("the timing run failed: killed")
        busy = 0.0 if asked.count(bundle.name) == 2 else 10.0
        return [float(int(bundle.name.split("-")[0]) + 1) + busy] * runs
    monkeypatch.setattr(timing.runner, "measure_alone", measure_alone)
    return asked


def _time(tmp_path, names, rounds=3):
    target, _ = load_target("x86")
    model = _model()
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)}
    return backend_timing.time_runs(model, "mlp", RUNS, names, target, feeds, tuning_db=tmp_path / "db", work=tmp_path,
                                    threads=2, runs=3, rounds=rounds, log=lambda s: None)


def test_every_run_is_built_checked_and_timed_on_each_backend(tmp_path, monkeypatch):
    asked = _fake_timer(monkeypatch)
    timed = _time(tmp_path, ("onnxruntime",))
    assert [(t.label, t.backend, t.ms) for t in timed] == [("whole", "onnxruntime", 1.0),
                                                           ("nodes 1-1", "onnxruntime", 2.0),
                                                           ("nodes 2-3", "onnxruntime", 3.0)]
    assert [t.nodes for t in timed] == list(RUNS)
    # every run in turn, round after round, each measurement a process of its own; the quickest round counts
    assert asked == ["0-onnxruntime", "1-onnxruntime", "2-onnxruntime"] * 3


def test_a_run_that_cannot_be_lowered_disagrees_or_fails_has_no_time_and_says_why(tmp_path, monkeypatch):
    asked = _fake_timer(monkeypatch, fail="1-onnxruntime")
    picky = Backend("picky", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                    compiler="edgesdk.backends.onnxruntime:compile_segment",
                    lowering="tests.scheduling.test_selection:no_relu")
    wrong = Backend("wrongsign", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                    compiler="tests.scheduling.test_selection:compile_negated",
                    lowering="edgesdk.backends.onnxruntime:lowering_reason")
    with backends.registered(picky), backends.registered(wrong):
        timed = {(t.label, t.backend): t for t in _time(tmp_path, ("onnxruntime", "picky", "wrongsign"))}
    assert timed["whole", "picky"].skipped == "cannot lower relu: the TEST DOUBLE has no Relu"
    assert timed["whole", "picky"].ms is None and timed["nodes 1-1", "picky"].ms == 2.0  # mm1 alone has no Relu
    assert all(timed[label, "wrongsign"].skipped.startswith(f"its {out} differs from onnxruntime by")
               for label, out in (("whole", "y"), ("nodes 1-1", "h"), ("nodes 2-3", "y")))
    assert timed["nodes 1-1", "onnxruntime"].skipped == "the timing run failed: killed"
    assert timed["whole", "onnxruntime"].ms == 1.0 and timed["nodes 2-3", "onnxruntime"].cut_bytes == 32 * 4
    # neither a refused nor a failed run is timed again
    assert asked.count("1-onnxruntime") == 1 and not any("wrongsign" in a for a in asked)


def test_runner_threads_are_set_for_the_timing_and_restored(monkeypatch):
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.setenv("EDGESDK_NUM_THREADS", "7")
    with backend_timing.runner_threads(3):
        assert os.environ["TVM_NUM_THREADS"] == os.environ["EDGESDK_NUM_THREADS"] == "3"
    assert "TVM_NUM_THREADS" not in os.environ and os.environ["EDGESDK_NUM_THREADS"] == "7"


@pytest.mark.parametrize("nodes, label", [(range(0, 3), "whole"), (range(1, 2), "nodes 2-2")])
def test_labels(nodes, label):
    assert backend_timing.label(nodes, 3) == label
