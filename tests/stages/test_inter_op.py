"""Inter-operator parallelism through the pipeline: the schedule stage turns independent branches
into parallel steps when the target's CPU figures say it pays, the bundle's runtime runs each step's
groups on worker threads with their thread counts, and the outputs equal onnxruntime's either way.

One x86 bundle of a three-branch model (TVM compiles its 5 segments): about 40 s on the 2-core build
machine.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from edgesdk.pipeline import BuildOptions, build
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
    build(BuildOptions(model=model, target=str(target), out=tmp / "par", seed=0))
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
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert all(threads[s].startswith("edgesdk-step") for s in step)
    assert all(threads[s] == threading.current_thread().name for s in threads if s not in step)
    threads.clear()
    bundle.parallel = False  # the same segments one after another, on the calling thread
    np.testing.assert_allclose(bundle.run({"x": x})["y"], got, rtol=0, atol=1e-6)
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
