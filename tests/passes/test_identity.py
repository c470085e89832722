"""No-op elimination: each no-op vanishes, near-no-ops stay, graph output names survive."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.passes.harness import EXACT, assert_same, check_does_not_fire, check_fires, f32, model, node, ops, optimized

X = {"x": [2, 3, 4]}


@pytest.mark.parametrize("op, args, rule", [
    ("Mul", ("x", "one"), "remove-mul-by-one"),
    ("Mul", ("one", "x"), "remove-mul-by-one"),
    ("Add", ("x", "zero"), "remove-add-zero"),
    ("Add", ("zero", "x"), "remove-add-zero"),
    ("Sub", ("x", "zero"), "remove-add-zero"),
    ("Div", ("x", "one"), "remove-div-by-one"),
])
def test_neutral_constant_is_removed(op, args, rule):
    # A (4,) constant of neutral elements broadcasts along x's last axis without growing it.
    m = model([node(op, list(args), ["y"]), node("Relu", ["y"], ["z"])], X, ["z"],
              {"one": np.ones(4, np.float32), "zero": np.zeros(4, np.float32)})
    check_fires(m, rule, gone=(op,))


def test_mul_by_almost_one_stays():
    # onnxscript's mul_by_1_rule matches 1.000005 (its constant match has rel_tol=1e-5).
    m = model([node("Mul", ["x", "c"], ["y"])], X, ["y"], {"c": f32(1.000005)})
    check_does_not_fire(m, "remove-mul-by-one", kept=("Mul",))


def test_ones_that_broadcast_x_to_a_larger_shape_stay():
    m = model([node("Mul", ["x", "c"], ["y"])], X, ["y"], {"c": np.ones((5, 1, 1, 1), np.float32)})
    check_does_not_fire(m, "remove-mul-by-one", kept=("Mul",))


def test_mul_by_a_non_constant_stays():
    m = model([node("Mul", ["x", "s"], ["y"])], {"x": [2, 3, 4], "s": [1]}, ["y"])
    check_does_not_fire(m, "remove-mul-by-one", kept=("Mul",))


def test_overridable_initializer_is_not_a_constant():
    # An initializer that is also a graph input is a default the caller may replace.
    m = model([node("Mul", ["x", "s"], ["y"])], {"x": [2, 3, 4], "s": []}, ["y"], {"s": f32(1.0)})
    out = check_does_not_fire(m, "remove-mul-by-one", kept=("Mul",))
    feeds = {"x": np.ones((2, 3, 4), np.float32), "s": f32(3.0)}
    assert_same(m, out, feeds=feeds, **EXACT)


def test_dropout_in_inference_mode_is_removed():
    m = model([node("Dropout", ["x", "ratio"], ["y"]), node("Relu", ["y"], ["z"])], X, ["z"],
              {"ratio": f32(0.5)})
    check_fires(m, "remove-dropout", gone=("Dropout",))


def test_dropout_with_constant_false_training_mode_is_removed():
    m = model([node("Dropout", ["x", "ratio", "training"], ["y"])], X, ["y"],
              {"ratio": f32(0.5), "training": np.array(False)})
    check_fires(m, "remove-dropout", gone=("Dropout",))


def test_dropout_in_training_mode_stays():
    # A fixed seed makes onnxruntime draw the same mask in both sessions, so outputs compare.
    m = model([node("Dropout", ["x", "ratio", "training"], ["y"], seed=7)], X, ["y"],
              {"ratio": f32(0.5), "training": np.array(True)})
    check_does_not_fire(m, "remove-dropout", kept=("Dropout",))


def test_dropout_whose_mask_is_used_is_left_to_the_folder():
    # remove-dropout refuses; onnxscript's folder replaces it by Identity and an all-true mask.
    m = model([node("Dropout", ["x"], ["y", "mask"]), node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),
               node("Add", ["y", "m"], ["z"])], X, ["z"])
    out, record = optimized(m)
    assert record["rules"]["remove-dropout"] == 0 and record["rules"]["fold-constants"] >= 1
    assert ops(out)["Dropout"] == 0
    assert_same(m, out, **EXACT)


def test_identity_chain_is_removed():
    m = model([node("Relu", ["x"], ["a"]), node("Identity", ["a"], ["b"]), node("Identity", ["b"], ["c"]),
               node("Neg", ["c"], ["y"])], X, ["y"])
    check_fires(m, "remove-identity", 2, gone=("Identity",))


@pytest.mark.parametrize("op, extra, init, attrs", [
    ("Reshape", ["shape"], {"shape": np.array([2, 0, -1], np.int64)}, {}),
    ("Squeeze", [], {}, {}),
    ("Flatten", [], {}, {"axis": 1}),
])
def test_no_op_shape_op_is_removed(op, extra, init, attrs):
    shape = [6, 4] if op == "Flatten" else [2, 3, 4]
    m = model([node("Relu", ["x"], ["a"]), node(op, ["a", *extra], ["b"], **attrs), node("Neg", ["b"], ["y"])],
              {"x": shape}, ["y"], init)
    check_fires(m, "remove-no-op-reshape", gone=(op,))


def test_reshape_that_changes_the_shape_stays():
    m = model([node("Relu", ["x"], ["a"]), node("Reshape", ["a", "shape"], ["b"]), node("Neg", ["b"], ["y"])],
              X, ["y"], {"shape": np.array([6, 4], np.int64)})
    check_does_not_fire(m, "remove-no-op-reshape", kept=("Reshape",))


def test_no_op_reshape_between_graph_input_and_output_keeps_both_names():
    m = model([node("Reshape", ["x", "shape"], ["y"])], X, ["y"], {"shape": np.array([2, 3, 4], np.int64)})
    out, record = optimized(m)
    assert record["rules"]["remove-no-op-reshape"] == 1
    assert ops(out) == {"Identity": 1}  # y = x needs a node: the names differ
    assert_same(m, out, **EXACT)


def test_no_op_reshape_feeding_a_graph_output_renames_its_input():
    m = model([node("Relu", ["x"], ["a"]), node("Reshape", ["a", "shape"], ["y"])], X, ["y"],
              {"shape": np.array([2, 3, 4], np.int64)})
    out = check_fires(m, "remove-no-op-reshape", gone=("Reshape", "Identity"))
    assert [n.output[0] for n in out.graph.node] == ["y"]


def test_identity_between_two_graph_outputs_keeps_both():
    # onnx_ir's IdentityEliminationPass would rename a to b here and lose the output name 'a'.
    m = model([node("Relu", ["x"], ["a"]), node("Identity", ["a"], ["b"])], X, ["a", "b"])
    out = check_does_not_fire(m, "remove-identity", kept=("Identity",))
    assert [o.name for o in out.graph.output] == ["a", "b"]


@pytest.mark.parametrize("op, attrs, rule", [
    ("Transpose", {"perm": [0, 1, 2]}, "remove-no-op-transpose"),
    ("Cast", {"to": TensorProto.FLOAT}, "remove-no-op-cast"),
])
def test_no_op_transpose_and_cast_are_removed(op, attrs, rule):
    m = model([node("Relu", ["x"], ["a"]), node(op, ["a"], ["b"], **attrs), node("Neg", ["b"], ["y"])], X, ["y"])
    check_fires(m, rule, gone=(op,))


def test_transpose_that_permutes_stays():
    m = model([node("Relu", ["x"], ["a"]), node("Transpose", ["a"], ["y"], perm=[0, 2, 1])], X, ["y"])
    check_does_not_fire(m, "remove-no-op-transpose", kept=("Transpose",))


def test_cast_that_converts_stays():
    m = model([node("Cast", ["x"], ["y"], to=TensorProto.INT32)], X, ["y"], output_types={"y": TensorProto.INT32})
    check_does_not_fire(m, "remove-no-op-cast", kept=("Cast",))


def test_no_op_expand_is_removed():
    m = model([node("Relu", ["x"], ["a"]), node("Expand", ["a", "shape"], ["b"]), node("Neg", ["b"], ["y"])],
              X, ["y"], {"shape": np.array([2, 3, 4], np.int64)})
    check_fires(m, "remove-no-op-expand", gone=("Expand",))


def test_no_op_inside_an_if_branch_is_removed_and_outer_names_survive():
    then_branch = helper.make_graph(
        [node("Mul", ["x", "one"], ["t"]), node("Relu", ["t"], ["then_out"])], "then", [],
        [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, [2, 3, 4])])
    # The else branch returns a value of the main graph through an Identity: removing it would
    # rename the outer value 'r' (onnx_ir's IdentityEliminationPass does, and the model breaks).
    else_branch = helper.make_graph(
        [node("Identity", ["r"], ["else_out"])], "else", [],
        [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [2, 3, 4])])
    m = model([node("Relu", ["x"], ["r"]), node("ReduceSum", ["x"], ["s"], keepdims=0),
               node("Greater", ["s", "zero"], ["cond"]),
               node("If", ["cond"], ["i"], then_branch=then_branch, else_branch=else_branch),
               node("Add", ["i", "r"], ["y"])],
              X, ["y"], {"one": f32(1.0), "zero": f32(0.0)})
    out, record = optimized(m)
    assert record["rules"]["remove-mul-by-one"] == 1
    assert [n.output[0] for n in out.graph.node if n.op_type == "Relu"] == ["r"]
    for seed in range(4):  # both branches taken
        assert_same(m, out, seed=seed, **EXACT)
