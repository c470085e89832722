"""`planner.make_plan` end to end on small ONNX graphs for arm_2tpu: a model that fits one Edge TPU is
replicated on both for a stream; legalize's rewrites are kept only where they predict faster than the model
as imported (`--no-rewrites`)."""

from __future__ import annotations

import json

import numpy as np
import onnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from edgesdk.config import load_target
from edgesdk.ir import model as irm
from edgesdk.scheduling.planner import make_plan


def _convs(capable: str, n: int = 6, channels: int = 32) -> onnx.ModelProto:
    """n 3x3 convolutions with ReLUs on 1x32x28x28, every node marked runnable on `capable`."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for k in range(n):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((channels, channels, 3, 3)) * 0.1).astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("Conv", [x, f"w{k}"], [f"c{k}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"])]
        x = f"r{k}"
    for node in nodes:
        irm.set_meta(node, irm.CAPABLE_KEY, capable)
    g = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 28, 28])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, channels, 28, 28])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


TARGET = load_target("arm_2tpu")[0]


def test_a_model_that_fits_one_tpu_is_replicated_for_a_stream():
    m = _convs("edgetpu,cpu/tvm")
    stream = make_plan(m, TARGET, mode="throughput", inter_op=False)
    assert stream.plan.replicas == ({"edgetpu:0": "edgetpu:1", "edgetpu:1": "edgetpu:0"},), stream.plan.search
    alone = stream.plan.baselines["coral default (first unsupported op onwards on the cpu)"]["throughput_fps"]
    assert stream.plan.predicted["throughput_fps"] >= 1.8 * alone
    assert "replicated" in stream.plan.search
    # each TPU holds the whole model, and co-compiles its copy
    instances = stream.plan.caches["instances"]
    assert set(instances) == {"edgetpu:0", "edgetpu:1"}
    assert instances["edgetpu:0"]["weights_bytes"] == instances["edgetpu:1"]["weights_bytes"] > 0
    assert instances["edgetpu:1"]["compile_order"] == [f"{s.id}.r1" for s in stream.plan.segments
                                                       if s.device == "edgetpu:0"]
    # the build's summary says so
    from edgesdk.report.text import placement_summary

    summary = placement_summary(json.loads(stream.plan.to_json()))
    assert "replica 1: a stream's frames alternate with a copy of the plan on edgetpu:0 -> edgetpu:1" in summary
    # one inference is never replicated
    assert make_plan(m, TARGET, mode="latency", inter_op=False).plan.replicas == ()


def test_legalize_never_makes_the_plan_slower_than_no_rewrites():
    """The 'legalized' graph runs on the CPU only, the graph 'as imported' on the Edge TPU: the plan places
    the model as imported and says why; the other way round it keeps the legalized graph."""
    on_cpu, on_tpu = _convs("cpu/tvm"), _convs("edgetpu,cpu/tvm")
    worse = make_plan(on_cpu, TARGET, mode="latency", inter_op=False, as_imported=lambda: on_tpu, rewritten=True)
    assert {s.device for s in worse.plan.segments} == {"edgetpu:0"}
    assert worse.plan.decisions[0].startswith("legalize's rewrites predict") and "places the model as imported" in \
        worse.plan.decisions[0]
    better = make_plan(on_tpu, TARGET, mode="latency", inter_op=False, as_imported=lambda: on_cpu, rewritten=True)
    assert {s.device for s in better.plan.segments} == {"edgetpu:0"}
    assert "keeps the rewrites" in better.plan.decisions[0]
    # nothing rewritten: the model as imported is not placed (nor loaded, on a target without vendor rules)
    loaded = []
    x86 = load_target("x86")[0]
    make_plan(_convs("cpu/tvm"), x86, mode="latency", inter_op=False, as_imported=lambda: loaded.append(1) or on_cpu)
    assert not loaded


def test_an_edge_tpu_run_is_cut_before_its_weights_pass_what_a_flatbuffer_holds():
    """The Edge TPU's compiler reads a TFLite FlatBuffer, which holds less than 2 GiB: a run of nodes on one
    TPU is cut before the node that would take its weights there (a segment of 2.5 GiB could never be
    compiled); the CPU's runs are not (their backends read weights of any size, or tune skips one that
    cannot)."""
    from edgesdk.backends import backend
    from edgesdk.scheduling.segments import split_by_backend

    gib = 1 << 30
    assert backend("tflite").max_weight_bytes == 2 * gib
    sizes = (3 * gib // 2, gib, gib // 4, gib // 4)
    runs = split_by_backend([(0, 4, "edgetpu:0")], ["tvm"] * 4, sizes)
    assert [(r.device, r.nodes) for r in runs] == [("edgetpu:0", [0]), ("edgetpu:0", [1, 2, 3])]
    assert [r.nodes for r in split_by_backend([(0, 4, "cpu")], ["tvm"] * 4, sizes)] == [[0, 1, 2, 3]]
    # without the sizes (or under the bound), one run, as before
    assert [r.nodes for r in split_by_backend([(0, 4, "edgetpu:0")], ["tvm"] * 4)] == [[0, 1, 2, 3]]


REPLICATION = "coral replication (the model on every edge tpu, frames dealt in turn)"


def _detector(n_back: int = 10, channels: int = 64, hw: int = 40) -> onnx.ModelProto:
    """A detector's shape: a backbone of 3x3 convolutions that fits one Edge TPU's cache, then a head with
    CPU-only ops (Pow, no Edge TPU op) around a small 1x1 prediction convolution."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [numpy_helper.from_array(np.array(2.0, np.float32), "two")], "x"

    def node(op, inputs, output, capable, **attrs):
        n = helper.make_node(op, inputs, [output], **attrs)
        irm.set_meta(n, irm.CAPABLE_KEY, capable)
        nodes.append(n)
        return output

    def conv(x, cin, cout, k, name):
        inits.append(numpy_helper.from_array((rng.standard_normal((cout, cin, k, k)) * 0.1).astype(np.float32), name))
        return node("Relu", [node("Conv", [x, name], name + "_c", "edgetpu,cpu/tvm", pads=[k // 2] * 4)], name + "_r",
                    "edgetpu,cpu/tvm")

    for k in range(n_back):
        x = conv(x, channels, channels, 3, f"b{k}")
    x = conv(node("Pow", [x, "two"], "p0", "cpu/tvm"), channels, 4, 1, "head")
    y = node("Pow", [x, "two"], "y", "cpu/tvm")
    g = helper.make_graph(nodes, "detector",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, hw, hw])],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, 4, hw, hw])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_baseline_predicted_better_is_the_plan():
    """The scheduler's own throughput plan for this detector (the backbone on one TPU, the prediction
    convolution on the other between the CPU's ops, the whole replicated) streams at 862 frames/s; Coral's
    replication (the backbone on each TPU, the head on the CPU) at 899: its placement is the plan, said so,
    and no reported baseline is predicted better than the plan."""
    m = _detector()
    stream = make_plan(m, TARGET, mode="throughput", inter_op=False)
    plan = stream.plan
    fps = plan.predicted["throughput_fps"]
    assert all(fps >= b["throughput_fps"] for b in plan.baselines.values() if "error" not in b), plan.baselines
    assert fps == plan.baselines[REPLICATION]["throughput_fps"]
    assert [(s.device, len(s.nodes)) for s in plan.segments] == [("edgetpu:0", 20), ("cpu", 4)]
    assert plan.replicas == ({"edgetpu:0": "edgetpu:1", "edgetpu:1": "edgetpu:0"},)
    chosen = plan.chosen
    assert chosen["candidate"] == f"baseline: {REPLICATION}" and chosen["objective"] == "throughput_fps"
    assert chosen["versus"] == "the scheduler's own plan" and chosen["throughput_fps"] == fps
    ours = chosen["versus_throughput_fps"]
    assert ours < fps and chosen["margin_percent"] == round(100 * (fps - ours) / ours, 2) > 1
    said = plan.decisions[0]
    assert said.startswith(f"the baseline '{REPLICATION}' predicts") and "takes the baseline's placement" in said
    assert REPLICATION in plan.search
    # the record survives plan.json, and the build's summary says which candidate won and by how much
    from edgesdk.report.text import placement_summary
    from edgesdk.scheduling.plan import Plan

    assert Plan.from_json(plan.to_json()) == plan
    summary = placement_summary(json.loads(plan.to_json()))
    assert f"chosen: the placement of the baseline '{REPLICATION}' ({fps:g} frames/s), " \
           f"{chosen['margin_percent']:.2f} % better than the scheduler's own plan ({ours:g} frames/s)" in summary
    # latency: the scheduler's own plan is as fast as the best baseline (a tie keeps it), none faster
    latency = make_plan(m, TARGET, mode="latency", inter_op=False).plan
    assert latency.chosen["candidate"] == "the scheduler's own plan" and latency.chosen["margin_percent"] >= 0
    assert all(latency.predicted["latency_ms"] <= b["latency_ms"]
               for b in latency.baselines.values() if "error" not in b)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 6), channels=st.sampled_from([8, 48, 96]),
       hw=st.sampled_from([8, 24, 48]), mode=st.sampled_from(["latency", "throughput"]))
@example(seed=3, n=5, channels=48, hw=8, mode="throughput")  # greedy's placement streamed faster than the DPs' plan
def test_the_plan_is_never_predicted_worse_than_a_baseline_it_reports(seed, n, channels, hw, mode):
    """Random chains of convolutions, ReLUs and CPU-only Pows, each convolution and ReLU runnable on the
    Edge TPU or not: the plan's figure on the mode's objective is at least every reported baseline's."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [numpy_helper.from_array(np.array(2.0, np.float32), "two")], "x"
    for k in range(n):
        op = rng.choice(["Conv", "Conv1", "Relu", "Pow"])
        capable = "cpu/tvm" if op == "Pow" or rng.random() < 0.3 else "edgetpu,cpu/tvm"
        if op.startswith("Conv"):
            size = 1 if op == "Conv1" else 3
            inits.append(numpy_helper.from_array(rng.normal(size=(channels, channels, size, size)).astype(np.float32),
                                                 f"w{k}"))
            node = helper.make_node("Conv", [x, f"w{k}"], [f"t{k}"], pads=[size // 2] * 4)
        else:
            node = helper.make_node(op, [x, "two"] if op == "Pow" else [x], [f"t{k}"])
        irm.set_meta(node, irm.CAPABLE_KEY, capable)
        nodes.append(node)
        x = f"t{k}"
    shape = [1, channels, hw, hw]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], inits)
    m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    plan = make_plan(m, TARGET, mode=mode, inter_op=False).plan
    key = "latency_ms" if mode == "latency" else "throughput_fps"
    sign = 1 if mode == "latency" else -1
    figures = {name: b[key] for name, b in plan.baselines.items() if "error" not in b}
    assert figures and all(sign * plan.predicted[key] <= sign * v for v in figures.values()), (plan.predicted, figures)
    assert plan.chosen["objective"] == key and plan.chosen[key] == plan.predicted[key]


def test_a_constant_never_goes_in_an_edge_tpu_segment():
    """A YOLOv8 head's anchor grid as exported (here with no import to fold it): ConstantOfShape, Range,
    Expand, Concat and Transpose that depend on no model input, read by the box decode. Placed by cost they
    once joined the Edge TPU's segment, whose output they then were: a constant the segment cannot give.
    Every such node is the host's (onnxruntime, in one run before the rest), never an accelerator's."""
    from edgesdk.legalization.legalize import annotated
    from tests import yolo_head

    model = annotated(yolo_head.model(grid_from_shape=False), TARGET)
    free = {irm.node_name(model.graph.node[i], i) for i in irm.input_free_nodes(model)}
    assert {"/grid0.stride", "/grid0.rx", "/grid0.gx", "/anchors"} <= free
    scheduled = make_plan(model, TARGET, mode="latency", inter_op=False)
    produced = {o for n in scheduled.model.graph.node if irm.node_name(n, 0) in free for o in n.output}
    segments = scheduled.plan.segments
    assert any(s.device.startswith("edgetpu") for s in segments)
    for s in segments:
        if s.device != "cpu":
            assert not free & set(s.nodes), (s.id, s.device, sorted(free & set(s.nodes)))
            assert not produced & set(s.outputs), (s.id, s.outputs)
    on_host = [s for s in segments if free & set(s.nodes)]
    assert [(s.id, s.backend, s.inputs) for s in on_host] == [("s0", "onnxruntime", ())]
    assert set(on_host[0].nodes) == free


def test_a_node_kept_on_the_cpu_never_lands_on_an_edge_tpu():
    """`keep_on_cpu` is a constraint of every placement: a chain of convolutions the Edge TPUs run whole is
    placed with its third convolution in float on the CPU, in latency and throughput mode (the pipelining DP,
    the replicas) and where the plan is the model as imported; the plan records where the node landed and
    the predicted latency with and without the constraint. A name the model lacks is refused."""
    import pytest

    from edgesdk.errors import UsageError

    m = _convs("edgetpu,cpu/tvm")
    free = make_plan(m, TARGET, mode="latency", inter_op=False)
    assert {s.device for s in free.plan.segments} <= {"edgetpu:0", "edgetpu:1"} and not free.plan.keep_on_cpu
    for mode in ("latency", "throughput"):
        for scheduled in (make_plan(m, TARGET, mode=mode, inter_op=False, keep_on_cpu=("Conv_4",)),
                          # the legalized graph on the CPU alone, the one as imported on the Edge TPU: the plan
                          # is the model as imported, and the pin holds there too
                          make_plan(_convs("cpu/tvm"), TARGET, mode=mode, inter_op=False, rewritten=True,
                                    as_imported=lambda: _convs("edgetpu,cpu/tvm"), keep_on_cpu=("Conv_4",))):
            plan = scheduled.plan
            holding = [s for s in plan.segments if "Conv_4" in s.nodes]
            assert [s.device for s in holding] == ["cpu"], (mode, [(s.device, s.nodes) for s in plan.segments])
            assert any(s.device.startswith("edgetpu") for s in plan.segments)
            for copy in plan.replica_segments():  # a stream's replicas move accelerator segments only
                assert all(s.device == "cpu" for s in copy if "Conv_4" in s.nodes)
            kept = plan.keep_on_cpu
            assert kept["nodes"] == ["Conv_4"] and kept["segments"] == {"Conv_4": holding[0].id}
            assert kept["predicted"]["latency_ms"] == plan.predicted["latency_ms"]
            assert kept["predicted"]["latency_ms_without"] < kept["predicted"]["latency_ms"]
            assert kept["predicted"]["cost_ms"] == pytest.approx(
                kept["predicted"]["latency_ms"] - kept["predicted"]["latency_ms_without"], abs=1e-3)
    pinned = make_plan(m, TARGET, mode="latency", inter_op=False, keep_on_cpu=("Conv_4",))
    assert json.loads(pinned.plan.to_json())["keep_on_cpu"]["nodes"] == ["Conv_4"]
    from edgesdk.scheduling.explain import node_rows  # schedule.html's placement table says why it is there

    assert {r["node"]: r["reason"] for r in node_rows(pinned)}["Conv_4"] == \
        "kept in float on the cpu for accuracy (plan.json keep_on_cpu)"
    with pytest.raises(UsageError) as e:
        make_plan(m, TARGET, mode="latency", inter_op=False, keep_on_cpu=("Conv_4", "/no/such/node"))
    assert e.value.code == "schedule.keep-on-cpu-unknown" and "/no/such/node" in e.value.message


def test_an_approximations_replaced_node_kept_on_the_cpu_stands_for_all_of_its_nodes():
    """A culprit that is one of legalize's approximations is named by the node it replaced: every node of
    the sum of ReLUs (named with its prefix) is kept on the CPU, and nothing else; the exact model keeps
    the replaced node itself there."""
    from edgesdk.scheduling.planner import cpu_only

    m = _convs("edgetpu,cpu/tvm", n=3)
    for k, node in enumerate(m.graph.node):
        node.name = f"approx1/{k}" if node.op_type == "Relu" and k < 4 else f"n{k}"
    approximations = [{"prefix": "approx1/", "nodes": ["/softplus"]}, {"prefix": "approx2/", "nodes": ["/gelu"]}]
    assert cpu_only(m, ("/softplus",), approximations) == {"approx1/1", "approx1/3"}
    assert cpu_only(m, ("/softplus", "n4"), approximations) == {"approx1/1", "approx1/3", "n4"}
    assert cpu_only(m, ("/gelu",), approximations) == frozenset() and cpu_only(m, (), approximations) == frozenset()
    plan = make_plan(m, TARGET, mode="latency", inter_op=False, approximations=approximations,
                     keep_on_cpu=("/softplus",)).plan
    holding = [s for s in plan.segments if {"approx1/1", "approx1/3"} & set(s.nodes)]
    assert holding and all(s.device == "cpu" for s in holding), [(s.device, s.nodes) for s in plan.segments]
    assert plan.keep_on_cpu["nodes"] == ["/softplus"] and set(plan.keep_on_cpu["segments"]) == {"approx1/1", "approx1/3"}
