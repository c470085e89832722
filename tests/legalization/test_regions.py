"""Unary regions: found where a chain of elementwise ops computes f(x), not where it does not; the
function they compute is the graph's own (onnxruntime), and replacing an exit keeps the graph valid."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgesdk.legalization import regions

SHAPE = [1, 4, 5, 5]


def _model(nodes, inits: dict, outputs=("y",)) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                          [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


def _gelu(prefix: str = "", x: str = "x", out: str = "y"):
    """tf2onnx's GELU: x * 0.5 * (1 + erf(x / sqrt 2))."""
    p = prefix
    nodes = [helper.make_node("Div", [x, "sqrt2"], [p + "d"], name=p + "div"),
             helper.make_node("Erf", [p + "d"], [p + "e"], name=p + "erf"),
             helper.make_node("Add", [p + "e", "one"], [p + "a"], name=p + "add"),
             helper.make_node("Mul", [x, p + "a"], [p + "m"], name=p + "mul"),
             helper.make_node("Mul", [p + "m", "half"], [out], name=p + "half")]
    return nodes, {"sqrt2": math.sqrt(2), "one": 1.0, "half": 0.5}


def test_gelu_is_one_region_and_computes_gelu():
    nodes, inits = _gelu()
    m = _model(nodes, inits)
    (r,) = regions.find(m, {"erf"})
    assert r.input == "x" and r.output == "y" and r.refused == ("erf",)
    assert len(r.nodes) == 5
    f = r.function(m)
    xs = np.linspace(-6, 6, 1001)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in xs])
    assert np.max(np.abs(f(xs) - want)) < 1e-6


def test_no_region_without_a_refused_node():
    nodes, inits = _gelu()
    assert regions.find(_model(nodes, inits), set()) == []
    assert regions.find(_model(nodes, inits), {"not-there"}) == []


def test_per_channel_constant_or_second_tensor_ends_the_region():
    # Mul by a per-channel scale depends on the position, not on x alone: it cannot join
    scale = np.arange(1, 5, dtype=np.float32).reshape(1, 4, 1, 1)
    m = _model([helper.make_node("Erf", ["x"], ["e"], name="erf"),
                helper.make_node("Mul", ["e", "scale"], ["y"], name="scale")], {"scale": scale})
    (r,) = regions.find(m, {"erf"})
    assert r.output == "e" and r.nodes == (0,)
    # x * erf(relu(x)) is unary in x; erf(x) + relu(x) too; but erf(x) + z with z another input is not
    g = helper.make_graph([helper.make_node("Erf", ["x"], ["e"], name="erf"),
                           helper.make_node("Add", ["e", "z"], ["y"], name="add")], "g",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in ("x", "z")],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m2 = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    (r2,) = regions.find(m2, {"erf"})
    assert r2.output == "e"


def test_an_inner_value_used_outside_is_an_exit_of_its_own():
    nodes, inits = _gelu()
    nodes.append(helper.make_node("Relu", ["e"], ["side"], name="side_use"))
    nodes.append(helper.make_node("Conv", ["side", "w"], ["y2"], name="conv"))  # a non-member consumer of e's chain
    m = _model(nodes, {**inits, "w": np.ones((4, 4, 1, 1), np.float32)}, outputs=("y", "y2"))
    found = {r.output: r for r in regions.find(m, {"erf"})}
    # y = gelu(x) and side = relu(erf(x / sqrt2)) both involve erf; e itself is consumed only in-region
    assert set(found) == {"y", "side"}


def test_replace_sends_consumers_to_the_new_value_and_keeps_output_names():
    import onnxruntime as ort

    nodes, inits = _gelu()
    nodes.append(helper.make_node("Relu", ["y"], ["z"], name="after"))
    m = _model(nodes, inits, outputs=("z",))
    (r,) = regions.find(m, {"erf"})
    # a stand-in "approximation": Relu(x), to see the rewiring (the real one is relu_sum.to_onnx)
    regions.replace(m, r, [helper.make_node("Relu", [r.input], ["approx"], name="approx")], [], "approx")
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    onnx.checker.check_model(m, full_check=True)
    x = np.random.default_rng(0).normal(size=SHAPE).astype(np.float32)
    (z,) = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})
    np.testing.assert_array_equal(z, np.maximum(x, 0))

    # the exit is a graph output: its name survives, the old value is renamed
    nodes, inits = _gelu()
    m = _model(nodes, inits)
    (r,) = regions.find(m, {"erf"})
    regions.replace(m, r, [helper.make_node("Relu", [r.input], ["approx"], name="approx")], [], "approx")
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(m, strict_mode=True), full_check=True)
    (y,) = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})
    np.testing.assert_array_equal(y, np.maximum(x, 0))
