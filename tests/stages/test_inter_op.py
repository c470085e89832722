"""Inter-operator parallelism through the pipeline: the schedule stage turns independent branches
into parallel steps when the target's CPU figures say it pays, the bundle's runtime runs each step's
groups on worker threads with their thread counts, and the outputs equal onnxruntime's either way
(within 1e-4 of the output's scale, as the bundle's self-test).

A plan is taken only when its predicted gain reaches `parallel.MIN_GAIN`: a transformer block whose
projections the DP would run at once for about 1 % stays one segment, and the plan says why.

One x86 bundle of a three-branch model (TVM compiles its 5 segments): about 40 s on the 2-core build
machine.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from edgesdk.pipeline import BuildOptions, build
from edgesdk.scheduling import parallel
from tests.backends.test_tvm import assert_close
from edgesdk.runtime import BundleModel, Manifest
from tests.model_zoo import ROOT

SHAPE = [1, 8, 16, 16]


def three_branches(path: Path) -> Path:
    """x -> three independent Conv -> Relu -> Conv branches -> Concat: small kernels, the case where
    running branches at once beats splitting each kernel over the cores."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for b in range(3):
        for k in range(2):
            inits.append(numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32), f"w{b}{k}"))
        nodes += [helper.make_node("Conv", ["x", f"w{b}0"], [f"a{b}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"a{b}"], [f"r{b}"]),
                  helper.make_node("Conv", [f"r{b}", f"w{b}1"], [f"c{b}"], pads=[1, 1, 1, 1])]
    nodes.append(helper.make_node("Concat", ["c0", "c1", "c2"], ["y"], axis=1))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24, 16, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return path


def attention_block(path: Path, seq: int = 32, width: int = 64, heads: int = 4, hidden: int = 128) -> Path:
    """A transformer encoder block: layer norm, then the query, key and value projections of the same
    input as three branches (each MatMul, bias, a positional scale and shift as a rotary step would
    apply, split into heads), attention, output projection, residual, feed-forward, residual."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(v, np.int64), n)
             for n, v in (("heads", [1, seq, heads, width // heads]), ("flat", [1, seq, width]))]
    inits.append(numpy_helper.from_array(np.float32(1 / np.sqrt(width // heads)), "temperature"))

    def weight(name: str, *shape: int) -> str:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, shape).astype(np.float32), name))
        return name

    def layer_norm(x: str, y: str) -> onnx.NodeProto:
        return helper.make_node("LayerNormalization", [x, weight(y + "_g", width), weight(y + "_b", width)], [y],
                                axis=-1)

    nodes = [layer_norm("x", "ln1")]
    for b, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [helper.make_node("MatMul", ["ln1", weight(f"w{b}", width, width)], [f"{b}0"]),
                  helper.make_node("Add", [f"{b}0", weight(f"b{b}", width)], [f"{b}1"]),
                  helper.make_node("Mul", [f"{b}1", weight(f"scale{b}", seq, width)], [f"{b}2"]),
                  helper.make_node("Add", [f"{b}2", weight(f"shift{b}", seq, width)], [f"{b}3"]),
                  helper.make_node("Reshape", [f"{b}3", "heads"], [f"{b}4"]),
                  helper.make_node("Transpose", [f"{b}4"], [b], perm=perm)]
    nodes += [helper.make_node("MatMul", ["q", "k"], ["scores"]),
              helper.make_node("Mul", ["scores", "temperature"], ["scaled"]),
              helper.make_node("Softmax", ["scaled"], ["attention"], axis=-1),
              helper.make_node("MatMul", ["attention", "v"], ["context"]),
              helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["context_t", "flat"], ["context_f"]),
              helper.make_node("MatMul", ["context_f", weight("wo", width, width)], ["o0"]),
              helper.make_node("Add", ["o0", weight("bo", width)], ["o1"]),
              helper.make_node("Add", ["x", "o1"], ["r1"]),
              layer_norm("r1", "ln2"),
              helper.make_node("MatMul", ["ln2", weight("w1", width, hidden)], ["f0"]),
              helper.make_node("Add", ["f0", weight("b1", hidden)], ["f1"]),
              helper.make_node("Relu", ["f1"], ["f2"]),
              helper.make_node("MatMul", ["f2", weight("w2", hidden, width)], ["f3"]),
              helper.make_node("Add", ["f3", weight("b2", width)], ["f4"]),
              helper.make_node("Add", ["r1", "f4"], ["y"])]
    g = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, width])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, width])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return path


def two_core_target(path: Path, efficiency: float | None, dispatch_us: float = 10.0) -> Path:
    """x86.yaml on 2 cores; `efficiency` sets how badly a kernel scales to the second core."""
    spec = yaml.safe_load((ROOT / "targets" / "x86.yaml").read_text())
    cpu = spec["devices"][0]
    cpu["cores"] = 2
    cpu["step_dispatch"] = {"value": dispatch_us, "unit": "us", "source": "test"}
    if efficiency is None:
        cpu.pop("parallel_efficiency", None)
    else:
        cpu["parallel_efficiency"] = {"value": efficiency, "unit": "1", "source": "test"}
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def branchy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inter_op")
    model = three_branches(tmp / "m.onnx")
    target = two_core_target(tmp / "t.yaml", efficiency=0.2)
    # the schedule's cut, unmeasured: these tests are about the parallel plan the schedule makes
    build(BuildOptions(model=model, target=str(target), out=tmp / "par", seed=0, cpu_backends=("planned",)))
    return tmp, model


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]


def test_branches_become_a_parallel_step(branchy):
    tmp, _ = branchy
    plan = json.loads((tmp / "par" / "bundle" / "plan.json").read_text())
    steps = plan["parallel_steps"]
    assert len(steps) == 1 and len(steps[0]) == 2  # 2 cores: at most two groups at once
    by_id = {s["id"]: s for s in plan["segments"]}
    assert all(by_id[s]["threads"] == 1 for s in steps[0])
    run = plan["inter_op"]["runs"][0]
    assert run["parallel_ms"] < run["sequential_ms"]
    assert plan["predicted"]["latency_ms"] == pytest.approx(run["parallel_ms"], rel=1e-3)
    manifest = Manifest.load(tmp / "par" / "bundle")
    assert manifest.parallel_steps == tuple(tuple(s) for s in steps) and manifest.cpu_threads == 2


def test_runtime_runs_the_groups_on_workers_and_matches_onnxruntime(branchy):
    tmp, model = branchy
    x = np.random.default_rng(3).normal(size=SHAPE).astype(np.float32)
    want = reference(model, x)
    bundle = BundleModel(tmp / "par" / "bundle", log=lambda s: None)
    step = set(bundle.manifest.parallel_steps[0])
    threads: dict[str, str] = {}
    for seg, runner in bundle.runners:
        def spy(feeds, _run=runner.run, _id=seg.id, **kw):
            threads[_id] = threading.current_thread().name
            return _run(feeds, **kw)
        runner.run = spy
    got = bundle.run({"x": x})["y"]
    assert_close(got, want)
    assert all(threads[s].startswith("edgesdk-step") for s in step)
    assert all(threads[s] == threading.current_thread().name for s in threads if s not in step)
    threads.clear()
    bundle.parallel = False  # the same segments one after another, on the calling thread
    # the same libraries on other threads: only a parallel loop's split of the work may change
    np.testing.assert_allclose(bundle.run({"x": x})["y"], got, rtol=0, atol=1e-6 * float(np.abs(want).max()))
    assert set(threads.values()) == {threading.current_thread().name}
    bundle.close()


def test_no_parallel_step_when_it_does_not_pay_or_when_turned_off(tmp_path, branchy):
    _, model = branchy
    # kernels that scale perfectly: running branches at once only overlaps their per-kernel overheads
    # (3 x 5 us per branch), less than handing them to workers
    perfect = two_core_target(tmp_path / "perfect.yaml", efficiency=None, dispatch_us=60.0)
    build(BuildOptions(model=model, target=str(perfect), out=tmp_path / "a", until="schedule"))
    plan = json.loads((tmp_path / "a/.build/3-schedule/plan.json").read_text())
    assert plan["parallel_steps"] == [] and len(plan["segments"]) == 1
    poor = two_core_target(tmp_path / "poor.yaml", efficiency=0.2)
    build(BuildOptions(model=model, target=str(poor), out=tmp_path / "b", until="schedule", inter_op=False))
    plan = json.loads((tmp_path / "b/.build/3-schedule/plan.json").read_text())
    assert plan["parallel_steps"] == [] and len(plan["segments"]) == 1


def test_a_tiny_predicted_gain_keeps_one_segment(tmp_path, monkeypatch):
    """The query, key and value branches of a transformer block on targets/x86.yaml: running them at
    once overlaps their per-kernel overheads for about 1 % of the block, less than the extra segments
    are worth. The CPU run stays one segment and the plan records the reason."""
    model = attention_block(tmp_path / "encoder.onnx")
    build(BuildOptions(model=model, target="x86", out=tmp_path / "a", until="schedule"))
    plan = json.loads((tmp_path / "a/.build/3-schedule/plan.json").read_text())
    assert plan["parallel_steps"] == [] and [s["device"] for s in plan["segments"]] == ["cpu"]
    (refused,) = plan["inter_op"]["not_taken"]
    assert plan["inter_op"]["runs"] == [] and refused["parallel_stages"] == 1  # the DP found the branches
    gain = 1 - refused["parallel_ms"] / refused["sequential_ms"]
    assert 0 < gain < parallel.MIN_GAIN
    said = re.fullmatch(r"inter-op parallelism not taken: predicted gain (\d+\.\d\d) % < 5 %", refused["reason"])
    assert said and float(said[1]) == pytest.approx(100 * gain, abs=0.05)  # the plan's ms are rounded
    record = json.loads((tmp_path / "a/.build/3-schedule/record.json").read_text())
    assert record["inter_op"]["not_taken"] == [refused]
    # without the threshold the same DP plan splits the run: three concurrent projections
    monkeypatch.setattr(parallel, "MIN_GAIN", 0.0)
    build(BuildOptions(model=model, target="x86", out=tmp_path / "b", until="schedule"))
    plan = json.loads((tmp_path / "b/.build/3-schedule/plan.json").read_text())
    assert [len(step) for step in plan["parallel_steps"]] == [3] and len(plan["segments"]) > 1
