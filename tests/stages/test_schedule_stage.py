"""The simple placement of the end-to-end issue: accelerator runs, round-robin over the TPUs, and
islands that would cost more on the accelerator (link transfers included) kept on the CPU."""

from __future__ import annotations

import json

import numpy as np
import yaml
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgesdk.pipeline import BuildOptions, build
from tests.model_zoo import ROOT


def _save(tmp_path, nodes, inits, shape_in, shape_out):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape_in)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape_out)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    return path


def _plan(tmp_path, path):
    # legalize's rewrites off: these tests need an op the Edge TPU refuses to stay where it is (an
    # approximation would move x**2 onto the TPU, or fail its bound on a wide range)
    build(BuildOptions(model=path, target="arm_2tpu", out=tmp_path / "o", until="schedule", legalize_rewrites=False))
    return json.loads((tmp_path / "o/.build/3-schedule/plan.json").read_text())


def test_accelerator_runs_alternate_over_both_tpus(tmp_path):
    rng = np.random.default_rng(0)
    w0 = numpy_helper.from_array(rng.normal(size=(32, 16, 3, 3)).astype(np.float32), "w0")
    w1 = numpy_helper.from_array(rng.normal(size=(32, 32, 3, 3)).astype(np.float32), "w1")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Pow", ["a", "two"], ["b"]),  # no Edge TPU op: the CPU runs it
             helper.make_node("Conv", ["b", "w1"], ["y"], pads=[1, 1, 1, 1])]
    plan = _plan(tmp_path, _save(tmp_path, nodes, [w0, w1, two], [1, 16, 64, 64], [1, 32, 64, 64]))
    assert [(s["device"], s["backend"]) for s in plan["segments"]] == [
        ("edgetpu:0", "tflite"), ("cpu", "tvm"), ("edgetpu:1", "tflite")]
    # segment boundaries are exactly the tensors that change device
    assert [s["outputs"] for s in plan["segments"]] == [["a"], ["b"], ["y"]]
    assert plan["predicted"]["latency_ms"] > 0


def test_cheap_island_stays_on_the_cpu(tmp_path):
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [helper.make_node("Pow", ["x", "two"], ["a"]),
             helper.make_node("Add", ["a", "one"], ["b"]),  # the TPU could, but not worth two USB trips
             helper.make_node("Pow", ["b", "two"], ["y"])]
    plan = _plan(tmp_path, _save(tmp_path, nodes, [one, two], [1, 8, 8], [1, 8, 8]))
    assert [s["device"] for s in plan["segments"]] == ["cpu"]
    assert len(plan["decisions"]) == 1 and "stay on the cpu" in plan["decisions"][0]
    legal = json.loads((tmp_path / "o/.build/2-legalize/legalize.json").read_text())
    assert any(r["op"] == "Pow" and r["device"] == "edgetpu" for r in legal["refusals"])


def _branchy(tmp_path):
    """conv -> [softplus island] -> conv -> conv: enough choice for the DP and the baselines to differ."""
    rng = np.random.default_rng(1)
    w = [numpy_helper.from_array(rng.normal(size=(16, 16, 3, 3)).astype(np.float32), f"w{i}") for i in range(4)]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Softplus", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c", "w2"], ["d"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["d", "w3"], ["y"], pads=[1, 1, 1, 1])]
    return _save(tmp_path, nodes, w, [1, 16, 32, 32], [1, 16, 32, 32])


def test_plan_is_no_worse_than_any_baseline_and_has_a_report(tmp_path):
    plan = _plan(tmp_path, _branchy(tmp_path))
    base = plan["baselines"]
    assert {"all on the cpu", "greedy (first capable accelerator)",
            "coral default (first unsupported op onwards on the cpu)",
            "coral --num_segments 2 (parameter-count split)"} <= set(base)
    # the DP is optimal for the sequential objective over the space every baseline lies in
    # (Coral's split needs a TPU prefix of at least 2 nodes; here Softplus ends it after one)
    assert "1-node Edge TPU prefix" in base["coral --num_segments 2 (parameter-count split)"]["error"]
    assert all(plan["predicted"]["sequential_ms"] <= b["sequential_ms"] + 1e-9 for b in base.values() if "error" not in b)
    # every baseline is a candidate: none is predicted faster than the plan, which says which it is
    assert all(plan["predicted"]["latency_ms"] <= b["latency_ms"] for b in base.values() if "error" not in b)
    assert plan["chosen"]["objective"] == "latency_ms"
    assert plan["chosen"]["latency_ms"] == plan["predicted"]["latency_ms"]
    assert plan["predicted"]["latency_ms"] <= plan["predicted"]["sequential_ms"] + 1e-9
    assert base["coral default (first unsupported op onwards on the cpu)"]["segments"] == 2
    # Coral's data parallelism: its default plan on each TPU, each TPU costed as holding every weight
    replicated = base["coral replication (the model on every edge tpu, frames dealt in turn)"]
    assert replicated["replicas"] == 2 and replicated["segments"] == 2
    assert replicated["latency_ms"] >= base["coral default (first unsupported op onwards on the cpu)"]["latency_ms"] - 1e-9
    # Coral's rules on the model as imported, before legalize approximated its Softplus: the TPU stops
    # at the Softplus (1 node), and the plan on the legalized model beats it
    from edgesdk.scheduling.planner import AS_IMPORTED

    imported = {k[:-len(AS_IMPORTED)]: v for k, v in base.items() if k.endswith(AS_IMPORTED)}
    assert set(imported) == {"coral default (first unsupported op onwards on the cpu)",
                             "coral --num_segments 2 (parameter-count split)",
                             "coral replication (the model on every edge tpu, frames dealt in turn)"}, set(imported)
    coral_alone = imported["coral default (first unsupported op onwards on the cpu)"]
    assert coral_alone["segments"] == 2 and plan["predicted"]["latency_ms"] < coral_alone["latency_ms"]
    report = (tmp_path / "o/.build/3-schedule/schedule.html").read_text()
    assert report.count("data:image/png;base64,") == 2 and "<th>bytes moved</th>" in report
    assert "<p>Chosen: " in report
    # each Edge TPU's cache and co-compile order, and the decisions where there are any
    assert "<h2>Parameter caches</h2>" in report
    assert ("<h2>Decisions</h2>" in report) == bool(plan["decisions"])
    for device in plan["caches"]["instances"]:
        assert f"<td>{device}</td>" in report
    assert all(0 <= u <= 1 for u in plan["utilization"].values())


def test_throughput_mode_pipelines_over_distinct_devices(tmp_path):
    build(BuildOptions(model=_branchy(tmp_path), target="arm_2tpu", out=tmp_path / "o", until="schedule",
                       legalize_rewrites=False, mode="throughput"))
    plan = json.loads((tmp_path / "o/.build/3-schedule/plan.json").read_text())
    by_id = {s["id"]: s for s in plan["segments"]}
    stage_devices = [{by_id[i]["device"] for i in stage} for stage in plan["pipeline_stages"]]
    assert all(len(d) == 1 for d in stage_devices)
    flat = [d.pop() for d in stage_devices]
    assert len(flat) == len(set(flat)), flat  # one stage per device
    latency = build(BuildOptions(model=_branchy(tmp_path), target="arm_2tpu", out=tmp_path / "l", until="schedule",
                                 legalize_rewrites=False))
    lat_plan = json.loads((tmp_path / "l/.build/3-schedule/plan.json").read_text())
    assert plan["predicted"]["throughput_fps"] >= lat_plan["predicted"]["throughput_fps"] - 1e-6


def test_throughput_mode_is_never_slower_than_the_latency_plan_streamed(tmp_path):
    # CPU-only ops (Pow) at both ends and in the middle: one contiguous stage per device would put the
    # whole graph on the CPU; the latency plan, streamed, keeps the convolutions on the TPUs
    rng = np.random.default_rng(2)
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    w = [numpy_helper.from_array(rng.normal(size=(32, 32, 3, 3)).astype(np.float32), f"w{i}") for i in range(4)]
    nodes = [helper.make_node("Pow", ["x", "two"], ["p0"]),
             helper.make_node("Conv", ["p0", "w0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["a", "w1"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Pow", ["b", "two"], ["p1"]),
             helper.make_node("Conv", ["p1", "w2"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c", "w3"], ["d"], pads=[1, 1, 1, 1]),
             helper.make_node("Pow", ["d", "two"], ["y"])]
    path = _save(tmp_path, nodes, [two, *w], [1, 32, 64, 64], [1, 32, 64, 64])
    plans = {}
    for mode in ("latency", "throughput"):
        build(BuildOptions(model=path, target="arm_2tpu", out=tmp_path / mode, until="schedule",
                           legalize_rewrites=False, mode=mode))
        plans[mode] = json.loads((tmp_path / mode / ".build/3-schedule/plan.json").read_text())
    lat, thr = plans["latency"], plans["throughput"]
    assert thr["predicted"]["throughput_fps"] >= lat["predicted"]["throughput_fps"]
    assert any(s["device"].startswith("edgetpu") for s in thr["segments"])
    assert thr["predicted"]["throughput_fps"] > thr["baselines"]["all on the cpu"]["throughput_fps"]
    assert "streamed" in thr["search"]


def test_an_approximation_the_plan_puts_on_the_cpu_is_left_exact(tmp_path):
    """arm_2tpu with its Edge TPUs on a USB 2.0 port (40 MB/s), and a Softplus over a million elements
    between two Floors (which no accelerator runs): legalize approximates it for the Edge TPU, but the
    two USB transfers there cost more than the ReLU sum (two convolutions) on the ARM CPU, so the plan
    keeps it on the CPU, where the Softplus itself is cheaper still. The schedule tries the region as exported, finds it faster, and the
    plan runs the exact Softplus; the decision says so with both figures."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Floor", ["x"], ["f"]), helper.make_node("Softplus", ["f"], ["s"], name="softplus"),
             helper.make_node("Floor", ["s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 256, 256])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 256, 256])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    calib = tmp_path / "calib"
    calib.mkdir()
    np.save(calib / "x.npy", rng.uniform(-0.5, 0.5, (4, 1, 16, 256, 256)).astype(np.float32))
    target = yaml.safe_load((ROOT / "targets" / "arm_2tpu.yaml").read_text())
    tpu = next(d for d in target["devices"] if d["kind"] == "edgetpu")
    tpu["link"]["name"] = "USB 2.0"
    tpu["link"]["bandwidth"] = {"value": 40.0, "unit": "MB/s", "source": "test: USB 2.0 high speed, about 40 MB/s"}
    (tmp_path / "usb2.yaml").write_text(yaml.safe_dump(target))
    build(BuildOptions(model=path, target=str(tmp_path / "usb2.yaml"), out=tmp_path / "o", until="schedule",
                       calib=calib))
    legalized = json.loads((tmp_path / "o/.build/2-legalize/legalize.json").read_text())
    assert [a["nodes"] for a in legalized["approximations"]] == [["softplus"]]
    assert (tmp_path / "o/.build/2-legalize/exact.onnx").exists()
    plan = json.loads((tmp_path / "o/.build/3-schedule/plan.json").read_text())
    said = plan["decisions"][0]
    assert said.startswith("legalize's approximations predict") and said.endswith("the plan leaves them exact"), said
    ops = [n.op_type for n in onnx.load(str(tmp_path / "o/.build/3-schedule/model.onnx")).graph.node]
    assert ops == ["Floor", "Softplus", "Floor"], ops
    assert {s["device"] for s in plan["segments"]} == {"cpu"}
