"""`BundleModel.stream`: frames pipelined over the devices, one worker per device.

A hand-made bundle of four onnxruntime segments on three devices (cpu, edgetpu:0, edgetpu:1, cpu again;
the device label decides the worker, the backend is onnxruntime so that it runs anywhere): results in
input order and equal to `run`, devices working on different frames at once, at most `depth` frames in
flight, an error reaching the caller with no thread left behind, and a clean early close. About 2 s.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgesdk.runtime import BundleModel
from edgesdk.runtime import manifest as mf
from edgesdk.runtime import streaming

SHAPE = (1, 4)


def _segment(root: Path, sid: str, device: str, op: str, inputs: list[str], output: str) -> mf.Segment:
    consts = []
    if op in ("Add", "Mul") and len(inputs) == 1:
        consts = [helper.make_tensor(f"{sid}_c", TensorProto.FLOAT, [], [1.0 if op == "Add" else 2.0])]
        inputs = [*inputs, f"{sid}_c"]
    g = helper.make_graph([helper.make_node(op, inputs, [output])], sid,
                          [helper.make_tensor_value_info(i, TensorProto.FLOAT, SHAPE) for i in inputs
                           if not i.endswith("_c")],
                          [helper.make_tensor_value_info(output, TensorProto.FLOAT, SHAPE)], consts)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    (root / "segments").mkdir(exist_ok=True)
    onnx.save(m, str(root / "segments" / f"{sid}.onnx"))
    spec = lambda n: mf.TensorSpec(n, SHAPE, "float32")  # noqa: E731
    return mf.Segment(sid, device, "onnxruntime", f"segments/{sid}.onnx",
                      tuple(spec(i) for i in inputs if not i.endswith("_c")), (spec(output),))


def write_bundle(root: Path, segments: tuple[mf.Segment, ...], **more) -> Path:
    """The manifest of a bundle taking x and giving y through `segments` (each a stage of its own)."""
    spec = lambda n: mf.TensorSpec(n, SHAPE, "float32")  # noqa: E731
    own = tuple(s for s in segments if not s.replica)
    manifest = mf.Manifest(schema_version=mf.SCHEMA_VERSION, sdk_version="test", min_runtime_version=mf.RUNTIME_VERSION,
                           model={"name": "test"}, target={"name": "test"}, arch="x86_64", device_map={},
                           inputs=(spec("x"),), outputs=(spec("y"),), segments=segments,
                           pipeline_stages=tuple((s.id,) for s in own), predicted={}, **more)
    (root / "manifest.json").write_text(manifest.to_json())
    return root


@pytest.fixture()
def bundle(tmp_path) -> Path:
    """cpu: a = x + 1 -> edgetpu:0: b = a * 2 -> edgetpu:1: c = relu(b) -> cpu: y = c + x"""
    return write_bundle(tmp_path, (_segment(tmp_path, "s0", "cpu", "Add", ["x"], "a"),
                                   _segment(tmp_path, "s1", "edgetpu:0", "Mul", ["a"], "b"),
                                   _segment(tmp_path, "s2", "edgetpu:1", "Relu", ["b"], "c"),
                                   _segment(tmp_path, "s3", "cpu", "Add", ["c", "x"], "y")))


def frames(n: int, log: list | None = None):
    for i in range(n):
        if log is not None:
            log.append(i)
        yield {"x": np.full(SHAPE, i - 3.5, np.float32)}


def expected(i: int) -> np.ndarray:
    x = np.full(SHAPE, i - 3.5, np.float32)
    return np.maximum((x + 1) * 2, 0) + x


def slowed(model: BundleModel, seconds: float, busy: dict, peak: list) -> None:
    """Each segment sleeps while it runs; record how many run at once."""
    lock = threading.Lock()
    for seg, runner in model.runners:
        def run(feeds, _run=runner.run, _id=seg.id):
            with lock:
                busy[_id] = True
                peak[0] = max(peak[0], sum(busy.values()))
            time.sleep(seconds)
            try:
                return _run(feeds)
            finally:
                with lock:
                    busy[_id] = False
        runner.run = run


def stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("edgesdk-stream")]


def test_results_in_order_equal_run_and_devices_overlap(bundle):
    model = BundleModel(bundle, log=lambda s: None)
    busy, peak = {}, [0]
    slowed(model, 0.02, busy, peak)
    got = list(model.stream(frames(8)))
    assert len(got) == 8
    for i, out in enumerate(got):
        np.testing.assert_array_equal(out["y"], expected(i))
        np.testing.assert_array_equal(out["y"], model.run({"x": np.full(SHAPE, i - 3.5, np.float32)})["y"])
    assert peak[0] >= 2, "no two devices ever worked at once"
    assert not stream_threads()


def test_at_most_depth_frames_in_flight(bundle):
    model = BundleModel(bundle, log=lambda s: None)
    pulled: list[int] = []
    for taken, _ in enumerate(model.stream(frames(10, pulled), depth=2)):
        assert len(pulled) - taken <= 2
    assert len(pulled) == 10


def test_an_error_reaches_the_caller_and_nothing_hangs(bundle):
    model = BundleModel(bundle, log=lambda s: None)
    seg, runner = model.runners[1]

    def fail_on_frame_5(feeds, _run=runner.run):
        if feeds["a"][0, 0] == 5 - 3.5 + 1:
            raise RuntimeError("segment s1 failed on frame 5")
        return _run(feeds)

    runner.run = fail_on_frame_5
    got = []
    with pytest.raises(RuntimeError, match="frame 5"):
        for out in model.stream(frames(9)):
            got.append(out)
    assert len(got) == 5  # frames 0..4, in order, before the failing one
    assert not stream_threads()


def test_bad_input_and_early_close_stop_the_workers(bundle):
    model = BundleModel(bundle, log=lambda s: None)
    it = model.stream(frames(100))
    next(it), next(it)
    it.close()
    assert not stream_threads()
    with pytest.raises(ValueError, match="shape"):
        list(model.stream([{"x": np.zeros((2, 2), np.float32)}]))
    assert not stream_threads()


def test_a_malformed_frame_is_raised_after_the_good_frames_before_it(bundle):
    """Frame 10 has the wrong shape: frames 0..9 are still yielded, in order, then the error."""
    model = BundleModel(bundle, log=lambda s: None)

    def with_bad_frame_10():
        for i, f in enumerate(frames(12)):
            yield {"x": np.zeros((2, 2), np.float32)} if i == 10 else f

    got = []
    with pytest.raises(ValueError, match="shape"):
        for out in model.stream(with_bad_frame_10()):
            got.append(out)
    assert len(got) == 10
    for i, out in enumerate(got):
        np.testing.assert_array_equal(out["y"], expected(i))
    assert not stream_threads()


@pytest.fixture()
def replicated(tmp_path) -> Path:
    """The plan cpu: a = x + 1 -> edgetpu:0: b = a * 2 -> cpu: y = b + x, and a replica with the Edge TPU
    segment on edgetpu:1 (the same model: data parallelism over two TPUs)."""
    s0 = _segment(tmp_path, "s0", "cpu", "Add", ["x"], "a")
    s1 = _segment(tmp_path, "s1", "edgetpu:0", "Mul", ["a"], "b")
    s2 = _segment(tmp_path, "s2", "cpu", "Add", ["b", "x"], "y")
    r1 = dataclasses.replace(s1, id="s1.r1", device="edgetpu:1", replica=1)
    return write_bundle(tmp_path, (s0, s1, s2, r1), replicas=(("s0", "s1.r1", "s2"),))


def test_replicas_take_alternate_frames_in_order_and_equal_run(replicated):
    model = BundleModel(replicated, log=lambda s: None)
    assert mf.Manifest.load(replicated).replicas == (("s0", "s1.r1", "s2"),)
    ran: list[tuple[str, float]] = []
    lock = threading.Lock()
    for seg, runner in model.runners:
        def run(feeds, _run=runner.run, _id=seg.id):
            time.sleep(0.01)
            with lock:
                ran.append((_id, float(next(iter(feeds.values()))[0, 0])))
            return _run(feeds)
        runner.run = run
    got = list(model.stream(frames(8)))
    for i, out in enumerate(got):
        np.testing.assert_array_equal(out["y"], (np.full(SHAPE, i - 3.5, np.float32) + 1) * 2 + (i - 3.5))
    tpu = {a: sid for sid, a in ran if sid.startswith("s1")}    # each frame's "a" -> the TPU segment that took it
    assert [tpu[i - 3.5 + 1] for i in range(8)] == ["s1", "s1.r1"] * 4
    ran.clear()
    model.run({"x": np.zeros(SHAPE, np.float32)})           # run() is the plan's own segments only
    assert [sid for sid, _ in ran] == ["s0", "s1", "s2"]
    assert not stream_threads()


def test_a_replica_naming_an_unknown_segment_is_refused(replicated):
    text = (replicated / "manifest.json").read_text().replace('"s1.r1",\n      "s2"', '"s9",\n      "s2"')
    with pytest.raises(mf.ManifestError, match=r"manifest.replicas\[0\].*s9"):
        mf.Manifest.from_json(text)


# --- the stream's own machinery, with fake runners (no model): `streaming.stream` directly -------------

GATE_S = 10.0   # a gate left shut (a regression) opens after this, so no thread is left behind for good


def _fake(sid: str, device: str, inputs: list[str], outputs: list[str]) -> mf.Segment:
    spec = lambda n: mf.TensorSpec(n, (2, 2), "float32")  # noqa: E731
    return mf.Segment(sid, device, "fake", f"{sid}.fake", tuple(map(spec, inputs)), tuple(map(spec, outputs)))


def _stream_in_thread(run, timeout: float = 2 * GATE_S) -> dict:
    """`run()` on a thread of its own, joined with a timeout: a stream that hangs fails the test instead of
    the suite. Returns {"result": ...} or {"error": ...}."""
    box: dict = {}

    def target():
        try:
            box["result"] = run()
        except BaseException as e:  # noqa: BLE001 -- looked at by the test
            box["error"] = e

    t = threading.Thread(target=target, name="test-stream-caller", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the stream hung: its caller still waits"
    return box


def test_tasks_are_taken_without_comparing_frames_that_hold_arrays():
    """Frames are never compared by value (their arrays have no truth value), so a device taking a later
    frame's task past an earlier one's does not kill its worker.

    cpu: a = x + 1;  tpu A: c = 3a;  tpu B: b = 2a;  cpu: d = b + 1;  cpu: y = c + d
    The replica swaps the two Edge TPUs. Frame 0 has c (edgetpu:0) but waits for b (edgetpu:1, held shut);
    frame 1 has b (edgetpu:0) but not yet c (edgetpu:1, busy with frame 0): the CPU's queue holds frame 0's
    "d" (not ready) before frame 1's "d" (ready), the two frames' values hold as many arrays ({x, a, c} and
    {x, a, b}), and taking frame 1's task used to compare them: ValueError in the CPU worker, then the
    caller waiting for ever on frame 0."""
    segs = [_fake("s0", "cpu", ["x"], ["a"]), _fake("s1", "edgetpu:0", ["a"], ["c"]),
            _fake("s2", "edgetpu:1", ["a"], ["b"]), _fake("s3", "cpu", ["b"], ["d"]),
            _fake("s4", "cpu", ["c", "d"], ["y"])]
    replica = [segs[0], dataclasses.replace(segs[1], id="s1.r1", device="edgetpu:1", replica=1),
               dataclasses.replace(segs[2], id="s2.r1", device="edgetpu:0", replica=1), segs[3], segs[4]]
    frame1_at_d = threading.Event()

    def b_of(f):          # tpu B; frame 0's is held until the CPU has taken frame 1's "d"
        if f["a"][0, 0] == 0 + 1:
            frame1_at_d.wait(GATE_S)
        return {"b": 2 * f["a"]}

    def d_of(f):
        if f["b"][0, 0] == 2 * (1 + 1):
            frame1_at_d.set()
        return {"d": f["b"] + 1}

    fn = {"s0": lambda f: {"a": f["x"] + 1}, "s1": lambda f: {"c": 3 * f["a"]}, "s2": b_of, "s3": d_of,
          "s4": lambda f: {"y": f["c"] + f["d"]}}
    plan = [(s, fn[s.id]) for s in segs]
    replicas = [[(s, fn[s.id.split(".")[0]]) for s in replica]]
    xs = [np.full((2, 2), i, np.float32) for i in range(2)]

    box = _stream_in_thread(lambda: list(streaming.stream(
        plan, lambda seg, runner, env: {t.name: env[t.name] for t in seg.inputs}, lambda runner, feeds: runner(feeds),
        lambda env: {"y": env["y"]}, ({"x": x} for x in xs), depth=2, replicas=replicas)))
    assert "error" not in box, box.get("error")
    assert len(box["result"]) == 2
    for x, out in zip(xs, box["result"]):
        np.testing.assert_array_equal(out["y"], 3 * (x + 1) + 2 * (x + 1) + 1)
    assert not stream_threads()


@pytest.mark.parametrize("where", ["feeds_of", "the worker's own loop"])
def test_a_workers_error_reaches_the_caller_and_nothing_waits_on_a_dead_worker(where, monkeypatch):
    """An exception in a worker, in a segment's feeds or in the worker's own bookkeeping (taking its next
    task), is raised by `stream()`; the other workers are stopped and joined."""
    segs = [_fake("s0", "cpu", ["x"], ["a"]), _fake("s1", "edgetpu:0", ["a"], ["b"]),
            _fake("s2", "cpu", ["b"], ["y"])]
    fn = {"s0": lambda f: {"a": f["x"] + 1}, "s1": lambda f: {"b": 2 * f["a"]}, "s2": lambda f: {"y": f["b"]}}

    def feeds_of(seg, runner, env):
        if where == "feeds_of" and seg.id == "s1":
            raise KeyError("feeds of s1 lost")
        return {t.name: env[t.name] for t in seg.inputs}

    if where != "feeds_of":
        take = streaming._take

        def broken(queue, ready):
            if threading.current_thread().name == "edgesdk-stream-edgetpu:0":
                raise RuntimeError("edgetpu:0's queue is broken")
            return take(queue, ready)

        monkeypatch.setattr(streaming, "_take", broken)
    frames_in = ({"x": np.full((2, 2), i, np.float32)} for i in range(6))
    box = _stream_in_thread(lambda: list(streaming.stream(
        [(s, fn[s.id]) for s in segs], feeds_of, lambda runner, feeds: runner(feeds), lambda env: {"y": env["y"]},
        frames_in, depth=3)))
    expected = KeyError if where == "feeds_of" else RuntimeError
    assert isinstance(box.get("error"), expected), box
    assert not stream_threads()


def test_the_self_tests_stream_check_reports_a_failed_stream(bundle, monkeypatch):
    """A stream that raises is a failed check with its reason (never an escaped exception), and the frames
    it never gave count as differing."""
    from edgesdk.runtime.selftest import stream_check

    model = BundleModel(bundle, log=lambda s: None)
    real = model.stream

    def fails_after_one(feeds, **kw):
        for k, out in enumerate(real(feeds, **kw)):
            if k == 1:
                raise RuntimeError("the stream's worker for edgetpu:0 failed")
            yield out

    monkeypatch.setattr(model, "stream", fails_after_one)
    s = stream_check(model, {"x": np.arange(4, dtype=np.float32).reshape(SHAPE)})
    assert not s["passed"] and s["mismatched_frames"] == [1, 2, 3]
    assert s["error"] == "RuntimeError: the stream's worker for edgetpu:0 failed"
    assert not stream_threads()
