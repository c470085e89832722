"""The per-node cost terms of devices/cost.py: flops of a transposed convolution, which nodes are
multiply-accumulate layers, and the CPU's optional per-layer overhead in node_ms."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.config import Target, load_target
from edgesdk.devices.cost import is_mac_layer, node_bytes, node_flops, node_ms
from edgesdk.ir import model as irm


def _model(nodes, inputs, initializers):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in initializers])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                             strict_mode=True)


@pytest.mark.parametrize("group", [1, 4])
def test_conv_transpose_counts_the_macs_of_its_adjoint_conv(group):
    # a stride-2 ConvTranspose (8, 5, 6) -> (12, 11, 13) and the Conv that is its adjoint, (12, 11, 13)
    # -> (8, 5, 6), share one weight tensor and multiply-accumulate the same (input, tap) pairs
    w = (8, 12 // group, 3, 3)
    up = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], group=group, output_padding=[0, 0])
    down = helper.make_node("Conv", ["y2", "w2"], ["x2"], strides=[2, 2], group=group)
    m = _model([up, down], [("x", (1, 8, 5, 6)), ("y2", (1, 12, 11, 13))], [("w", w), ("w2", (8, 12 // group, 3, 3))])
    shapes = irm.static_shapes(m)
    assert shapes["y"] == (1, 12, 11, 13) and shapes["x2"] == (1, 8, 5, 6)
    transposed, adjoint = (node_flops(n, shapes) for n in m.graph.node)
    assert transposed == adjoint == 2 * (8 * 5 * 6) * (12 // group) * 9


def test_mac_layers_are_the_convolutions_and_matrix_products():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Conv", ["r", "dw"], ["d"], pads=[1, 1, 1, 1], group=16),                # depthwise
        helper.make_node("Conv", ["d", "pw"], ["s"], strides=[2, 2]),                             # strided 1x1
        helper.make_node("Add", ["s", "s"], ["a"]),
        helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("ConvTranspose", ["p", "tw"], ["u"], strides=[2, 2]),
        helper.make_node("Concat", ["u", "u"], ["cc"], axis=1),
        helper.make_node("GlobalAveragePool", ["cc"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["gm"], transB=1),
        helper.make_node("MatMul", ["gm", "mm"], ["mt"]),
        helper.make_node("Softmax", ["mt"], ["out"]),
    ]
    m = _model(nodes, [("x", (1, 3, 32, 32))],
               [("w", (16, 3, 3, 3)), ("dw", (16, 1, 3, 3)), ("pw", (24, 16, 1, 1)), ("tw", (24, 8, 3, 3)),
                ("fc", (10, 16)), ("mm", (10, 5))])
    shapes, consts = irm.static_shapes(m), irm.constant_names(m)
    for n in m.graph.node:
        flops, (_, acts) = node_flops(n, shapes), node_bytes(n, shapes, consts)
        assert is_mac_layer(flops, acts) == (n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")), n.op_type


def test_a_degenerate_strided_conv_is_no_layer():
    # the documented exception: a stride-2 1x1 convolution from 8 channels to 1 does 2 x 8 flops per
    # output but touches 33 activation elements per output (4 positions x 8 channels in, 1 out)
    n = helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 2])
    m = _model([n], [("x", (1, 8, 8, 8))], [("w", (1, 8, 1, 1))])
    shapes, consts = irm.static_shapes(m), irm.constant_names(m)
    flops, (_, acts) = node_flops(n, shapes), node_bytes(n, shapes, consts)
    assert flops == 2 * 16 * 8 and acts == 4 * (8 * 64 + 16)
    assert not is_mac_layer(flops, acts)


def _with_layer_overhead(target: Target, us: float | None) -> Target:
    data = target.model_dump(mode="json")
    data["devices"][0]["layer_overhead"] = None if us is None else {"value": us, "unit": "us", "source": "test"}
    return Target.model_validate(data)


def test_only_layers_pay_the_cpu_layer_overhead():
    arm, _ = load_target("arm_2tpu")
    plain, layered = _with_layer_overhead(arm, None), _with_layer_overhead(arm, 500.0)
    conv = {"flops": 2e7, "param_bytes": 40_000, "act_bytes": 200_000}     # 100 flops per element touched
    relu = {"flops": 5e4, "param_bytes": 0, "act_bytes": 400_000}         # memory-bound, 1/8 flop per element
    assert node_ms(layered, "cpu", **conv) == pytest.approx(node_ms(plain, "cpu", **conv) + 0.5, rel=1e-12)
    assert node_ms(layered, "cpu", **relu) == node_ms(plain, "cpu", **relu)
    host = plain.host
    expected = 1e3 * max(2e7 / (host.peak_gflops["float32"].value * 1e9), 240_000 / (host.memory_bandwidth.value * 1e9))
    assert node_ms(plain, "cpu", **conv) == pytest.approx(expected + host.kernel_overhead.value * 1e-3, rel=1e-12)
    # the Edge TPU has no layer overhead: the CPU's does not leak into it
    assert node_ms(layered, "edgetpu", **conv) == node_ms(plain, "edgetpu", **conv)


@pytest.mark.parametrize("name", ["x86", "rtx3090"])
def test_targets_without_a_layer_overhead_are_unchanged(name):
    t, _ = load_target(name)
    assert t.host.layer_overhead is None
    host = t.host
    for flops, acts in ((2e7, 200_000), (5e4, 400_000)):
        roof = max(flops / (host.peak_gflops["float32"].value * 1e9), acts / (host.memory_bandwidth.value * 1e9))
        assert math.isclose(node_ms(t, "cpu", flops=flops, param_bytes=0, act_bytes=acts),
                            1e3 * roof + host.kernel_overhead.value * 1e-3, rel_tol=1e-12)


def test_arm_2tpu_fitted_figures_name_their_fit():
    arm, _ = load_target("arm_2tpu")
    for figure in (arm.host.peak_gflops["float32"], arm.host.layer_overhead,
                   arm.devices[1].peak_tops_int8, arm.devices[1].kernel_overhead):
        assert "benchmarks/fit_arm_2tpu.py" in figure.source and "coral.ai/docs/edgetpu/benchmarks" in figure.source
    # effective rates below the published peaks
    assert arm.host.peak_gflops["float32"].value < 24.0 and arm.devices[1].peak_tops_int8.value < 4.0


def _fig(value: float, unit: str) -> dict:
    return {"value": value, "unit": unit, "source": "a test's own figure"}


def test_a_cpu_backend_is_costed_with_its_own_figures_and_the_cpus_for_the_rest():
    x86, _ = load_target("x86")
    data = x86.model_dump(mode="json")
    data["devices"][0]["peak_gflops"]["float32_grouped"] = _fig(20.0, "GFLOP/s")
    data["devices"][0]["backends"] = {"litert": {"peak_gflops": {"float32": _fig(100.0, "GFLOP/s")},
                                                 "kernel_overhead": _fig(50.0, "us")}}
    t = Target.model_validate(data)
    host = t.host
    conv = {"flops": 2e7, "param_bytes": 40_000, "act_bytes": 200_000}
    relu = {"flops": 5e4, "param_bytes": 0, "act_bytes": 4_000_000}
    # litert's peak and overhead; the bandwidth it leaves out is the CPU's
    assert node_ms(t, "cpu", backend="litert", **conv) == pytest.approx(
        1e3 * max(2e7 / 100e9, 240_000 / (host.memory_bandwidth.value * 1e9)) + 0.05, rel=1e-12)
    assert node_ms(t, "cpu", backend="litert", **relu) == pytest.approx(
        1e3 * 4e6 / (host.memory_bandwidth.value * 1e9) + 0.05, rel=1e-12)
    # key by key: a grouped convolution on litert runs at the CPU's grouped rate, which litert does not give
    assert node_ms(t, "cpu", backend="litert", grouped=True, **conv) == pytest.approx(
        1e3 * 2e7 / 20e9 + 0.05, rel=1e-12)
    # another backend, or none, is costed with the CPU's figures as before
    plain = Target.model_validate({**data, "devices": [{**data["devices"][0], "backends": {}}]})
    for backend in (None, "tvm", "onnxruntime"):
        for node in (conv, relu):
            assert node_ms(t, "cpu", backend=backend, **node) == node_ms(plain, "cpu", **node)


def test_a_backends_cache_tier_costs_the_nodes_that_fit_at_its_bandwidth():
    x86, _ = load_target("x86")
    data = x86.model_dump(mode="json")
    data["devices"][0]["backends"] = {"litert": {"memory_bandwidth": _fig(20.0, "GB/s"),
                                                 "kernel_overhead": _fig(1.0, "us"),
                                                 "cache_bandwidth": _fig(500.0, "GB/s"),
                                                 "cache_capacity": _fig(4.0, "MiB")}}
    t = Target.model_validate(data)
    fits = {"flops": 5e4, "param_bytes": 0, "act_bytes": 4 * 2**20}  # exactly the capacity: in cache
    spills = {"flops": 5e4, "param_bytes": 1, "act_bytes": 4 * 2**20}
    assert node_ms(t, "cpu", backend="litert", **fits) == pytest.approx(1e3 * 4 * 2**20 / 500e9 + 1e-3, rel=1e-12)
    assert node_ms(t, "cpu", backend="litert", **spills) == pytest.approx(
        1e3 * (4 * 2**20 + 1) / 20e9 + 1e-3, rel=1e-12)


def test_targets_without_backend_figures_load_as_before():
    for name in ("x86", "arm_2tpu", "rtx3090"):
        t, _ = load_target(name)
        assert t.host.backends == {}
