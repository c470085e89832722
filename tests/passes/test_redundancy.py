"""CSE, dead code, initializer deduplication."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tests.passes.harness import check_does_not_fire, check_fires, f32, model, node, ops

X = {"x": [2, 3]}


def test_duplicate_subexpression_is_computed_once():
    m = model([node("Relu", ["x"], ["a"]), node("Relu", ["x"], ["b"]), node("Sigmoid", ["a"], ["c"]),
               node("Sigmoid", ["b"], ["d"]), node("Add", ["c", "d"], ["y"])], X, ["y"])
    out = check_fires(m, "eliminate-common-subexpressions", 2)
    assert ops(out) == {"Relu": 1, "Sigmoid": 1, "Add": 1}


def test_duplicates_that_are_both_graph_outputs_keep_their_names():
    m = model([node("Relu", ["x"], ["a"]), node("Relu", ["x"], ["b"])], X, ["a", "b"])
    out = check_fires(m, "eliminate-common-subexpressions", 1)
    assert [o.name for o in out.graph.output] == ["a", "b"]


def test_same_op_on_different_inputs_stays():
    m = model([node("Relu", ["x"], ["a"]), node("Relu", ["z"], ["b"]), node("Add", ["a", "b"], ["y"])],
              {**X, "z": [2, 3]}, ["y"])
    check_does_not_fire(m, "eliminate-common-subexpressions", kept=("Relu",))


def test_random_ops_are_never_merged():
    m = model([node("RandomUniformLike", ["x"], ["a"], seed=1.0), node("RandomUniformLike", ["x"], ["b"], seed=1.0),
               node("Sub", ["a", "b"], ["c"]), node("Mul", ["c", "zero"], ["y"])], X, ["y"], {"zero": f32(0.0)})
    check_does_not_fire(m, "eliminate-common-subexpressions", kept=("RandomUniformLike",))


def test_dead_nodes_are_removed():
    m = model([node("Relu", ["x"], ["a"]), node("Exp", ["x"], ["dead"]), node("Neg", ["dead"], ["dead2"])],
              X, ["a"])
    out = check_fires(m, "remove-dead-nodes", 2, gone=("Exp", "Neg"))
    assert ops(out) == {"Relu": 1}


def test_equal_initializers_are_merged_and_their_nodes_with_them():
    c = np.arange(3, dtype=np.float32)
    m = model([node("Add", ["x", "c1"], ["a"]), node("Add", ["x", "c2"], ["b"]), node("Mul", ["a", "b"], ["y"])],
              X, ["y"], {"c1": c, "c2": c.copy()})
    out = check_fires(m, "deduplicate-initializers", 1)
    assert ops(out) == {"Add": 1, "Mul": 1}
    assert len(out.graph.initializer) == 1


def test_initializers_only_a_dropped_if_branch_read_are_removed():
    """An If with a constant condition is inlined; what only the other branch read must go too."""
    then_g = helper.make_graph([helper.make_node("Add", ["x", "a"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    else_g = helper.make_graph([helper.make_node("Mul", ["x", "b"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    g = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array(True), "c"), numpy_helper.from_array(np.ones(2, np.float32), "a"),
         numpy_helper.from_array(np.full(2, 3.0, np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    out = check_fires(m, "fold-constants", gone=("If",))
    assert [n.op_type for n in out.graph.node] == ["Add"]
    assert {t.name for t in out.graph.initializer} == {"a"}
