"""The runtime's stream against the scheduler's model of it (`simulate.worker_stream`): device doubles that
sleep each segment's predicted time, streamed through `BundleModel.stream`, reach the frames per second
the simulator predicts, within 15 %, on plans where one device holds several stages (the CPU holding the
first, a middle and the last segment; one Edge TPU holding two) so that consecutive frames overlap.

TEST DOUBLES: the Edge TPU segments are onnxruntime segments labelled edgetpu:0 and edgetpu:1 (no Edge
TPU here) and every segment sleeps its predicted time; the policy under test is the runtime's own
stream code (runtime/streaming.py). Sleeps of 6-24 ms keep the machine's noise (its other load, the
thread switches) small against them; about 3 s in all.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgesdk.runtime import BundleModel
from edgesdk.scheduling import simulate
from tests.runtime.test_stream import _segment, frames, write_bundle

FRAMES = 40

# (id, device, op, inputs, output, ms): a chain, each segment reading the one before it
PLANS = {
    "cpu holds three stages": [
        ("s0", "cpu", "Add", ["x"], "a", 6.0), ("s1", "edgetpu:0", "Mul", ["a"], "b", 20.0),
        ("s2", "cpu", "Relu", ["b"], "c", 6.0), ("s3", "edgetpu:1", "Mul", ["c"], "d", 18.0),
        ("s4", "cpu", "Add", ["d"], "y", 8.0)],
    "one tpu holds two stages": [
        ("s0", "cpu", "Add", ["x"], "a", 6.0), ("s1", "edgetpu:0", "Mul", ["a"], "b", 12.0),
        ("s2", "edgetpu:1", "Relu", ["b"], "c", 24.0), ("s3", "edgetpu:0", "Mul", ["c"], "d", 12.0),
        ("s4", "cpu", "Add", ["d"], "y", 6.0)],
}


def _bundle(root: Path, plan) -> Path:
    return write_bundle(root, tuple(_segment(root, sid, device, op, inputs, output)
                                    for sid, device, op, inputs, output, _ in plan))


@pytest.mark.parametrize("name", PLANS)
def test_the_runtime_streams_as_fast_as_the_simulator_predicts(name, tmp_path):
    plan = PLANS[name]
    model = BundleModel(_bundle(tmp_path, plan), log=lambda s: None)
    ms = {sid: t for sid, *_, t in plan}
    for seg, runner in model.runners:        # each segment sleeps its predicted time, then runs
        def run(feeds, _run=runner.run, _ms=ms[seg.id]):
            time.sleep(_ms / 1000)
            return _run(feeds)
        runner.run = run
    produced = {output: sid for sid, _, _, _, output, _ in plan}
    tasks = [simulate.Task(sid, device, t, tuple(produced[i] for i in inputs if i in produced))
             for sid, device, _, inputs, _, t in plan]
    depth = len({device for _, device, *_ in plan}) + 1          # the stream's default
    predicted = simulate.worker_stream([tasks], FRAMES, depth)

    yielded, t0 = [], time.perf_counter()
    for _ in model.stream(frames(FRAMES)):
        yielded.append(1000 * (time.perf_counter() - t0))
    measured = simulate.steady_fps(yielded)

    sequential = 1000 / sum(ms.values())
    assert predicted.throughput_fps > 1.3 * sequential           # the plan does overlap frames
    print(f"{name}: measured {measured:.1f} frames/s, predicted {predicted.throughput_fps:.1f}, one after another {sequential:.1f}")
    assert measured == pytest.approx(predicted.throughput_fps, rel=0.15), (measured, predicted.throughput_fps)


def test_worker_stream_by_hand():
    """Two devices, a 1 ms CPU task then a 3 ms TPU task per frame, two frames in flight: the TPU is the
    bottleneck and a frame leaves every 3 ms; with one frame in flight nothing overlaps (4 ms each)."""
    plan = [simulate.Task("a", "cpu", 1.0), simulate.Task("b", "edgetpu:0", 3.0, ("a",))]
    two = simulate.worker_stream([plan], 6, depth=2)
    assert [e.end_ms for e in two.events if e.resource == "edgetpu:0"] == [4.0, 7.0, 10.0, 13.0, 16.0, 19.0]
    assert two.busy_ms == {"cpu": 6.0, "edgetpu:0": 18.0} and two.makespan_ms == 19.0
    assert two.throughput_fps == pytest.approx(1000 / 3.0)
    one = simulate.worker_stream([plan], 3, depth=1)
    assert one.latency_ms == (4.0, 4.0, 4.0) and one.makespan_ms == 12.0
    # replicas: frames dealt in turn to a plan on edgetpu:0 and one on edgetpu:1; the CPU feeds both
    other = [simulate.Task("a", "cpu", 1.0), simulate.Task("b", "edgetpu:1", 3.0, ("a",))]
    both = simulate.worker_stream([plan, other], 8, depth=3)
    assert both.throughput_fps == pytest.approx(2 * 1000 / 3.0, rel=0.01)
    with pytest.raises(ValueError, match="stuck"):
        simulate.worker_stream([[simulate.Task("a", "cpu", 1.0, ("missing",))]], 1, 1)
