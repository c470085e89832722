"""Constant folding: constant subgraphs become initializers; quantization nodes stay."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

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
