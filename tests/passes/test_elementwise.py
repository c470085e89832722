"""Elementwise chains: constants of Mul/Div and Add/Sub chains combined into one."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from tests.passes.harness import EXACT, REASSOCIATED, check_does_not_fire, check_fires, f32, model, node, ops

X = {"x": [2, 3, 4]}


@pytest.mark.parametrize("inner, outer, rule, left", [
    ("Mul", "Mul", "merge-mul-chain", "Mul"),
    ("Mul", "Div", "merge-mul-chain", "Mul"),
    ("Div", "Mul", "merge-mul-chain", "Mul"),
    ("Div", "Div", "merge-mul-chain", "Div"),
    ("Add", "Add", "merge-add-chain", "Add"),
    ("Add", "Sub", "merge-add-chain", "Add"),
    ("Sub", "Add", "merge-add-chain", "Add"),
    ("Sub", "Sub", "merge-add-chain", "Sub"),
])
def test_per_channel_chain_becomes_one_op(inner, outer, rule, left):
    # The result keeps its op type where both links agree, and is a Mul/Add otherwise.
    m = model([node(inner, ["x", "a"], ["t"]), node(outer, ["t", "s"], ["y"])], X, ["y"],
              {"a": f32([0.5, -2.0, 3.0, 0.75]), "s": f32(1.25)})
    out = check_fires(m, rule, tolerance=REASSOCIATED)
    assert ops(out) == {left: 1}


def test_constant_first_operands_are_matched():
    m = model([node("Mul", ["a", "x"], ["t"]), node("Mul", ["s", "t"], ["y"])], X, ["y"],
              {"a": f32([0.5, -2.0, 3.0, 0.75]), "s": f32(1.25)})
    out = check_fires(m, "merge-mul-chain", tolerance=REASSOCIATED)
    assert ops(out) == {"Mul": 1}


def test_integer_chains_are_exact():
    m = model([node("Add", ["x", "a"], ["t"]), node("Sub", ["t", "b"], ["u"]), node("Mul", ["u", "c"], ["v"]),
               node("Mul", ["v", "d"], ["y"])], X, ["y"],
              {"a": np.int64(7), "b": np.array([1, 2, 3, 4], np.int64), "c": np.int64(3), "d": np.int64(-5)},
              input_type=TensorProto.INT64)
    out = check_fires(m, "merge-add-chain", tolerance=EXACT)
    assert ops(out) == {"Add": 1, "Mul": 1}


def test_integer_division_chain_stays():
    # (x / 2) * 3 truncates before it multiplies: it is not x * 1.5.
    m = model([node("Div", ["x", "a"], ["t"]), node("Mul", ["t", "b"], ["y"])], X, ["y"],
              {"a": np.int64(2), "b": np.int64(3)}, input_type=TensorProto.INT64)
    check_does_not_fire(m, "merge-mul-chain", kept=("Div", "Mul"))


def test_non_constant_operand_stays():
    m = model([node("Mul", ["x", "z"], ["t"]), node("Mul", ["t", "s"], ["y"])], {**X, "z": [4]}, ["y"],
              {"s": f32(2.0)})
    check_does_not_fire(m, "merge-mul-chain", kept=("Mul",))


def test_combined_constant_larger_than_both_together_stays():
    # (3, 1) + (1, 3) would store a (3, 3) constant: 9 numbers for 6.
    m = model([node("Add", ["x", "a"], ["t"]), node("Add", ["t", "b"], ["y"])], {"x": [2, 1, 1]}, ["y"],
              {"a": np.ones((3, 1), np.float32), "b": np.ones((1, 3), np.float32)})
    check_does_not_fire(m, "merge-add-chain", kept=("Add",))


def test_intermediate_used_twice_stays():
    m = model([node("Mul", ["x", "a"], ["t"]), node("Mul", ["t", "s"], ["u"]), node("Add", ["t", "u"], ["y"])],
              X, ["y"], {"a": f32(3.0), "s": f32(2.0)})
    check_does_not_fire(m, "merge-mul-chain", kept=("Mul",))


def test_overflowing_product_stays():
    # 1e30 * 1e30 overflows float32, while (x * 1e30) * 1e30 is finite for |x| < 3e-23.
    m = model([node("Mul", ["x", "a"], ["t"]), node("Mul", ["t", "b"], ["y"])], X, ["y"],
              {"a": f32(1e30), "b": f32(1e30)})
    check_does_not_fire(m, "merge-mul-chain", kept=("Mul",))
