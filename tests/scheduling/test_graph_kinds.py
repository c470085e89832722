"""The placement problem is built over the device registry: for every shipped combination of kinds it
is the problem the kind-by-kind code before it built (device order, every cost bit for bit, links,
CPU backends), and the vendor baselines are those of the kinds present."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.config import Target, load_target
from edgesdk.devices.cost import (is_grouped, link_ms_per_byte, node_bytes, node_flops, node_ms, streamed_fraction,
                                  tensor_bytes)
from edgesdk.ir import model as irm
from edgesdk.scheduling import baselines
from edgesdk.scheduling.graph import build_problem
from edgesdk.scheduling.problem import Link, Problem, Tensor


def _old_build_problem(model, target, shapes, consts):  # scheduling/graph.py at c4e5e36
    g = model.graph
    kinds = {d.kind for d in target.devices}
    devices = ["cpu"] + [i for kind in ("edgetpu", "gpu") if kind in kinds for i in target.logical_ids(kind)]
    producer = {t: i for i, n in enumerate(g.node) for t in n.output if t}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(g.node):
        for t in dict.fromkeys(n.input):
            if t and t not in consts:
                consumers.setdefault(t, []).append(i)
    caps = [(irm.get_meta(n, irm.CAPABLE_KEY) or "cpu/onnxruntime").split(",") for n in g.node]
    weights, acts = zip(*(node_bytes(n, shapes, consts) for n in g.node)) if g.node else ((), ())
    tpu_weights = sum(w for w, c in zip(weights, caps) if "edgetpu" in c)
    streamed = streamed_fraction(target, tpu_weights)
    cost, cpu_backend = [], []
    for n, c, w, act in zip(g.node, caps, weights, acts):
        flops = node_flops(n, shapes)
        per = {"cpu": node_ms(target, "cpu", flops=flops, param_bytes=w, act_bytes=act, grouped=is_grouped(n))}
        for kind in ("edgetpu", "gpu"):
            if kind in c and kind in kinds:
                ms = node_ms(target, kind, flops=flops, param_bytes=w, act_bytes=act,
                             streamed_fraction=streamed if kind == "edgetpu" else 0.0)
                per.update({dev: ms for dev in target.logical_ids(kind)})
        cost.append(per)
        cpu_backend.append(next((x.split("/")[1] for x in c if x.startswith("cpu/")), "onnxruntime"))
    outputs = {o.name for o in g.output}
    tensors = [Tensor(t, tensor_bytes(shapes.get(t)), producer.get(t), tuple(consumers.get(t, ())), t in outputs)
               for t in dict.fromkeys([*consumers, *outputs])]
    links = {}
    for dev in devices[1:]:
        latency, per_byte = link_ms_per_byte(target, dev.split(":")[0])
        links[dev] = Link(latency, per_byte)
    names = tuple(irm.node_name(n, i) for i, n in enumerate(g.node))
    return Problem(names, tuple(devices), tuple(cost), tuple(tensors), {d: 0.0 for d in devices}, links,
                   tuple(weights)), cpu_backend


CAPABLE = ["edgetpu,gpu,cpu/tvm", "gpu,cpu/tvm", "edgetpu,cpu/tvm", "cpu/onnxruntime", "edgetpu,cpu/onnxruntime",
           None]


def _model(capable: list[str | None], width: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c0", "w1"], ["c1"], pads=[1, 1, 1, 1], group=width),   # depthwise
             helper.make_node("Relu", ["c1"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["c2"]),
             helper.make_node("Add", ["c2", "c0"], ["a"]),
             helper.make_node("GlobalAveragePool", ["a"], ["y"])]
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("w0", (width, 3, 3, 3)), ("w1", (width, 1, 3, 3)), ("w2", (width, width, 1, 1)))]
    for n, c in zip(nodes, capable):
        if c is not None:
            irm.set_meta(n, irm.CAPABLE_KEY, c)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 3, 56, 56))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _targets() -> list[Target]:
    arm, gpu, x86 = (load_target(n)[0] for n in ("arm_2tpu", "rtx3090", "x86"))
    both = arm.model_dump(mode="json")
    both["devices"].append(gpu.model_dump(mode="json")["devices"][1])  # the host, 2 Edge TPUs and a GPU
    grouped = arm.model_dump(mode="json")
    grouped["devices"][0]["peak_gflops"]["float32_grouped"] = {"value": 1.7, "unit": "GFLOP/s", "source": "test"}
    small = arm.model_dump(mode="json")  # a cache too small for the weights: a share of them streams
    small["devices"][1]["on_chip_memory"]["value"] = 0.05
    return [arm, gpu, x86, Target.model_validate(both), Target.model_validate(grouped), Target.model_validate(small)]


@pytest.mark.parametrize("target", _targets(), ids=lambda t: "+".join(d.kind for d in t.devices))
def test_the_problem_is_the_old_one(target):
    for width, capable in itertools.product((8, 512), list(itertools.permutations(CAPABLE))[::37]):
        m = _model(list(capable), width)
        shapes, consts = irm.static_shapes(m), irm.constant_names(m)
        new, new_backends = build_problem(m, target, shapes, consts)
        old, old_backends = _old_build_problem(m, target, shapes, consts)
        # what the old code built is the same; the parameter cache's fields (scheduling/cache.py) are new
        assert dataclasses.replace(new, weight_keys=(), key_bytes={}, cache_bytes={}, stream_ms=(), streamed=()) == old
        assert new_backends == old_backends
        assert [list(c) for c in new.cost] == [list(c) for c in old.cost]                    # key order too
        assert [[v.hex() for v in c.values()] for c in new.cost] == [[v.hex() for v in c.values()] for c in old.cost]


def test_replicated_plans_cost_each_tpu_as_holding_every_weight():
    """Weights that fit two TPUs' caches together but not one: built, they are spread over both and
    nothing streams; with the whole model on each TPU (Coral's replication, priced by `cache.recost`),
    a share streams and the TPU nodes cost more. Where one cache holds them, recosting changes nothing."""
    from edgesdk.scheduling import cache

    arm, _ = load_target("arm_2tpu")
    m = _model(["edgetpu,cpu/tvm"] * 4 + [None, None], 512)      # w2 alone: 512 x 512 float32 = 1 MiB
    shapes, consts = irm.static_shapes(m), irm.constant_names(m)
    int8_mb = sum(node_bytes(n, shapes, consts)[0] for n in m.graph.node) / 4 / 1e6
    data = arm.model_dump(mode="json")
    data["devices"][1]["on_chip_memory"]["value"] = 0.6 * int8_mb    # one cache holds 60 %, two hold all
    target = Target.model_validate(data)
    spread, _ = build_problem(m, target, shapes, consts)
    plans = baselines.coral_replicated(spread, ["edgetpu:0", "edgetpu:1"])
    whole = cache.recost(spread, plans)
    conv = 3  # the 1x1 convolution with most of the weights
    assert whole.cost[conv]["edgetpu:0"] > spread.cost[conv]["edgetpu:0"]
    assert whole.cost[conv]["edgetpu:1"] == whole.cost[conv]["edgetpu:0"]
    assert whole.cost[conv]["cpu"] == spread.cost[conv]["cpu"]
    fits, _ = build_problem(m, arm, shapes, consts)
    assert cache.recost(fits, baselines.coral_replicated(fits, ["edgetpu:0", "edgetpu:1"])).cost == fits.cost


def test_vendor_baselines_by_kind():
    assert list(baselines.vendor_rules("edgetpu", ["edgetpu:0"])) == [
        "coral default (first unsupported op onwards on the cpu)"]
    assert list(baselines.vendor_rules("edgetpu", ["edgetpu:0", "edgetpu:1"])) == [
        "coral default (first unsupported op onwards on the cpu)", "coral --num_segments 2 (parameter-count split)"]
    assert baselines.vendor_rules("edgetpu", []) == {} and baselines.vendor_rules("gpu", ["gpu:0"]) == {}


def test_a_host_node_costs_what_it_costs_on_its_cpu_backend():
    # x86 with figures of its own for TVM: the nodes legalize gave TVM cost TVM's figures on the host, the
    # others (onnxruntime) the CPU's; the parallel DP's costs read the same
    x86, _ = load_target("x86")
    data = x86.model_dump(mode="json")
    data["devices"][0]["backends"] = {"tvm": {"kernel_overhead": {"value": 400.0, "unit": "us", "source": "test"}}}
    target = Target.model_validate(data)
    m = _model(["cpu/tvm", "cpu/onnxruntime", "cpu/tvm", "cpu/tvm", None, "cpu/onnxruntime"], 8)
    shapes, consts = irm.static_shapes(m), irm.constant_names(m)
    problem, backends = build_problem(m, target, shapes, consts)
    plain, _ = build_problem(m, x86, shapes, consts)
    assert backends == ["tvm", "onnxruntime", "tvm", "tvm", "onnxruntime", "onnxruntime"]
    for i, b in enumerate(backends):
        gap = (400.0 - x86.host.kernel_overhead.value) * 1e-3 if b == "tvm" else 0.0
        assert problem.node_ms(i, "cpu") == pytest.approx(plain.node_ms(i, "cpu") + gap, rel=1e-12)
    from edgesdk.scheduling.interop import _CpuCosts

    costs = _CpuCosts(m, target, problem, shapes, consts, dict(enumerate(backends)))
    assert [costs.cost(i, target.host.cores) for i in range(len(backends))] == pytest.approx(
        [problem.node_ms(i, "cpu") for i in range(len(backends))], rel=1e-12)
