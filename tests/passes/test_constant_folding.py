"""Constant folding: constant subgraphs become initializers; quantization nodes stay."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from edgesdk.ir import model as irm
from edgesdk.passes import constant_folding
from tests import yolo_head
from tests.passes.harness import EXACT, check_fires, const, f32, model, node, ops, optimized, assert_same

X = {"x": [2, 3]}


def test_constant_subexpression_is_folded():
    m = model([const("a", f32([1, 2, 3])), const("b", f32([4, 5, 6])), node("Add", ["a", "b"], ["c"]),
               node("Sqrt", ["c"], ["d"]), node("Mul", ["x", "d"], ["y"])], X, ["y"])
    out = check_fires(m, "fold-constants", 2, gone=("Add", "Sqrt", "Constant"))
    assert ops(out) == {"Mul": 1}


def test_shape_of_a_static_tensor_is_folded():
    m = model([node("Shape", ["x"], ["s"]), node("Reshape", ["x", "s"], ["r"]), node("Relu", ["r"], ["y"])],
              X, ["y"])
    out, record = optimized(m)
    assert record["rules"]["fold-constants"] >= 1
    assert ops(out) == {"Relu": 1}
    assert_same(m, out, **EXACT)


def test_constant_nodes_are_lifted_to_initializers():
    m = model([const("c", f32([1, 2, 3])), node("Mul", ["x", "c"], ["y"])], X, ["y"])
    out = check_fires(m, "lift-constants-to-initializers", gone=("Constant",))
    assert [i.name for i in out.graph.initializer] == ["c"]


def test_dequantize_of_a_constant_weight_is_kept():
    # Folding DequantizeLinear(int8 weight) would lose the quantization the accelerators need.
    w = np.arange(-6, 6, dtype=np.int8).reshape(4, 3)
    m = model([node("DequantizeLinear", ["w", "scale", "zp"], ["wf"]), node("MatMul", ["x", "wf"], ["y"])],
              {"x": [2, 4]}, ["y"], {"w": w, "scale": f32(0.05), "zp": np.int8(1)})
    out, record = optimized(m)
    assert ops(out)["DequantizeLinear"] == 1
    assert {i.data_type for i in out.graph.initializer} >= {TensorProto.INT8}
    assert_same(m, out, **EXACT)


def test_small_constant_of_shape_is_folded_so_a_pad_gets_constant_pads():
    # exporters build Pad's pads with ConstantOfShape + Concat (silero-vad's STFT padding); unfolded,
    # Pad's output shape is unknown and everything after it is dynamic
    m = model([node("ConstantOfShape", ["n"], ["zeros"], value=numpy_helper.from_array(np.zeros(1, np.int64))),
               node("Concat", ["zeros", "tail"], ["pads"], axis=0), node("Pad", ["x", "pads"], ["y"], mode="reflect")],
              X, {"y": [2, 5]}, {"n": np.array([2], np.int64), "tail": np.array([0, 2], np.int64)})
    out = check_fires(m, "fold-constants", 2, gone=("ConstantOfShape", "Concat"))
    assert ops(out) == {"Pad": 1}
    (pad,) = out.graph.node
    (pads,) = [t for t in out.graph.initializer if t.name == pad.input[1]]
    assert numpy_helper.to_array(pads).tolist() == [0, 0, 0, 2]


def test_a_constant_of_shape_that_depends_on_no_input_is_folded():
    # 4,096 elements (past onnxscript's 1,024) that do not depend on x: an initializer, not work each inference
    m = model([node("ConstantOfShape", ["n"], ["big"], value=numpy_helper.from_array(f32([2.0]))),
               node("Add", ["x", "big"], ["y"])], {"x": [64, 64]}, ["y"], {"n": np.array([64, 64], np.int64)})
    out = check_fires(m, "fold-constants", 1, gone=("ConstantOfShape",))
    assert ops(out) == {"Add": 1}


def test_a_constant_past_the_bound_is_kept():
    # one element more than MAX_FOLDED_ELEMENTS: not evaluated at build time (legalize gives it to the host)
    n = constant_folding.MAX_FOLDED_ELEMENTS + 1
    m = model([node("ConstantOfShape", ["n"], ["big"]), node("Slice", ["big", "start", "stop"], ["part"]),
               node("Add", ["x", "part"], ["y"])],
              {"x": [4]}, ["y"], {"n": np.array([n], np.int64), "start": np.array([0], np.int64),
                                  "stop": np.array([4], np.int64)})
    out, _ = optimized(m)
    assert ops(out) == {"ConstantOfShape": 1, "Slice": 1, "Add": 1}
    assert_same(m, out, **EXACT)


def test_the_anchor_grid_of_a_detection_head_is_folded_whole():
    """YOLOv8's head computes its anchor points and strides from the feature maps' shapes (Shape, Range,
    Expand, Concat, a ConstantOfShape of h*w = 1,600 strides): all of it is folded, past onnxscript's own
    limits, so that nothing of it is left to run, on the CPU or in an accelerator segment."""
    m = yolo_head.model()
    out, record = optimized(m)
    left = ops(out)
    assert not {"ConstantOfShape", "Range", "Expand", "Shape", "Gather", "Cast", "Unsqueeze"} & set(left), left
    assert irm.input_free_nodes(out) == set()
    anchors = max((numpy_helper.to_array(t) for t in out.graph.initializer), key=lambda a: a.size)
    assert anchors.shape == (2, 2100)  # the grid's points, 40x40 + 20x20 + 10x10
    assert_same(m, out, **EXACT)
