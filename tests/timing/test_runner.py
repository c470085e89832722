"""The runners that run and time a bundle (edgesdk/timing/runner.py): in this process, in a fresh
process of its own (`python -m edgesdk.timing.child`), and the test double. What is asserted never
depends on how long anything took: only that each runner computes the same outputs and gives one
figure per timed run."""

from __future__ import annotations

import numpy as np
import pytest

from edgesdk.config import load_target
from edgesdk.scheduling import selection
from edgesdk.scheduling.plan import PlanSegment
from edgesdk.timing import FakeRunner, FreshProcess, InProcess
from tests.numeric import assert_close
from tests.scheduling.test_selection import _model


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The test model's three nodes as a one-segment onnxruntime bundle, built as the tune stage builds a candidate."""
    tmp = tmp_path_factory.mktemp("runner")
    model = _model()
    seg = PlanSegment("s0", "cpu", "onnxruntime", "segments/s0.onnx", ("mm1", "relu", "mm2"), ("x",), ("y",), 0.0, 0, 1.0)
    target, _ = load_target("x86")
    selection.build(selection.Candidate("onnxruntime", (seg,)), {"s0": model}, target, tmp / "onnxruntime",
                    tmp / "db")
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    np.savez(tmp / "feeds.npz", x=x)
    return tmp / "onnxruntime", tmp / "feeds.npz", [{"x": x}, {"x": 2 * x}]


@pytest.mark.parametrize("runner", [InProcess(), FreshProcess()], ids=["in-process", "fresh-process"])
def test_each_runner_runs_the_bundle_alike_and_times_each_run(bundle, runner):
    path, feeds_file, feeds = bundle
    reference = InProcess().open(path)
    try:
        want = reference.run_all(feeds)
    finally:
        reference.close()
    handle = runner.open(path)
    try:
        assert [t.name for t in handle.inputs] == ["x"] and [t.name for t in handle.outputs] == ["y"]
        got = handle.run_all(feeds)
        assert_close(handle.run(feeds[1])["y"], want[1]["y"])
    finally:
        handle.close()
    for g, w in zip(got, want):
        assert_close(g["y"], w["y"])
    laps = runner.measure(path, feeds_file, warmup=1, runs=3)
    assert len(laps) == 3 and all(ms > 0 for ms in laps)


def test_a_fresh_process_that_fails_says_why(bundle, tmp_path):
    path, _, _ = bundle
    with pytest.raises(RuntimeError, match="the timing run failed: "):
        FreshProcess().measure(path, tmp_path / "absent.npz", warmup=0, runs=1)


def test_the_fake_runner_runs_for_real_and_says_how_long(bundle):
    path, feeds_file, feeds = bundle
    runner = FakeRunner({"onnxruntime": 0.25})
    handle = runner.open(path)
    try:
        assert set(handle.run_all(feeds)[0]) == {"y"}
    finally:
        handle.close()
    assert runner.measure(path, feeds_file, runs=4) == [0.25] * 4 and runner.asked == ["onnxruntime"]
