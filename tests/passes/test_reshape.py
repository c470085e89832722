"""Reshape chains: consecutive shape-only ops become one Reshape."""

from __future__ import annotations

import numpy as np
import pytest

from onnx import TensorProto

from tests.passes.harness import EXACT, assert_same, check_does_not_fire, check_fires, model, node, ops, optimized, random_feeds

X = {"x": [2, 3, 4]}


def shape(*dims) -> np.ndarray:
    return np.array(dims, np.int64)


def test_reshape_reshape_becomes_one():
    m = model([node("Reshape", ["x", "s1"], ["a"]), node("Reshape", ["a", "s2"], ["y"])], X, ["y"],
              {"s1": shape(6, -1), "s2": shape(0, 2, 2)})
    out = check_fires(m, "merge-reshape-chain")
    assert ops(out) == {"Reshape": 1}


@pytest.mark.parametrize("first, second", [("Flatten", "Unsqueeze"), ("Unsqueeze", "Squeeze"),
                                           ("Squeeze", "Flatten"), ("Reshape", "Squeeze")])
def test_shape_op_pairs_become_one_reshape(first, second):
    # x is (2, 1, 3, 4) so that Squeeze has a unit axis to remove.
    args = {"Flatten": ([], {"axis": 2}), "Unsqueeze": (["ax0"], {}), "Squeeze": (["ax1"], {}),
            "Reshape": (["s"], {})}
    inits = {"ax0": shape(0), "ax1": shape(1), "s": shape(2, 1, 12)}
    if first == "Unsqueeze":
        inits["ax1"] = shape(0)
    extra1, attrs1 = args[first]
    extra2, attrs2 = args[second]
    m = model([node(first, ["x", *extra1], ["a"], **attrs1), node(second, ["a", *extra2], ["b"], **attrs2),
               node("Neg", ["b"], ["y"])], {"x": [2, 1, 3, 4]}, ["y"], inits)
    out = check_fires(m, "merge-reshape-chain", gone=tuple({first, second} - {"Reshape"}))
    assert ops(out)["Reshape"] <= 1


def test_intermediate_that_is_a_graph_output_stays():
    m = model([node("Reshape", ["x", "s1"], ["a"]), node("Reshape", ["a", "s2"], ["y"])], X, ["y", "a"],
              {"s1": shape(6, 4), "s2": shape(24)})
    check_does_not_fire(m, "merge-reshape-chain", kept=("Reshape",))


def test_intermediate_used_twice_stays():
    m = model([node("Reshape", ["x", "s1"], ["a"]), node("Reshape", ["a", "s2"], ["b"]),
               node("Relu", ["a"], ["c"])], X, ["b", "c"], {"s1": shape(6, 4), "s2": shape(24)})
    check_does_not_fire(m, "merge-reshape-chain", kept=("Reshape",))


def test_shape_from_a_graph_input_stays():
    # A shape that arrives at run time does not fix the chain's result.
    m = model([node("Reshape", ["x", "s1"], ["a"]), node("Reshape", ["a", "s2"], ["y"])], {**X, "s2": [1]},
              ["y"], {"s1": shape(6, 4)}, input_types={"s2": TensorProto.INT64})
    out, record = optimized(m)
    assert record["rules"]["merge-reshape-chain"] == 0 and ops(out)["Reshape"] == 2
    feeds = random_feeds(m, fixed={"s2": shape(24)})
    assert_same(m, out, feeds=feeds, **EXACT)
