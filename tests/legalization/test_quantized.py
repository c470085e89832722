"""float-of-quantized (legalization/quantized.py): a QDQ model's int8 weights become the float constants its
DequantizeLinear computes, bit for bit, and its activations' QuantizeLinear -> DequantizeLinear pairs go,
moving each activation by at most half of its pair's step (and its clipping to the int8 range, which the
inputs here stay inside); what is not such a pair stays. A full-int8 TFLite file through import is in
tests/frontends/test_tensorflow.py."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from tests.legalization.harness import BITWISE, check_does_not_fire, check_fires, legalized
from tests.passes.harness import model, node, ops, run

RULE = "float-of-quantized"
RNG = np.random.default_rng(5)


def _conv_qdq(per_channel: bool, pair: bool = True):
    """x -> [Q -> DQ] -> Conv(DQ(int8 W), DQ(int32 bias)) -> y, as tf2onnx writes a full-int8 TFLite conv."""
    w = RNG.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)
    w_scale = (RNG.uniform(0.001, 0.01, 4) if per_channel else np.array(0.004)).astype(np.float32)
    inits = {"w": w, "w_scale": w_scale, "w_zero": np.zeros(w_scale.shape, np.int8),
             "b": RNG.integers(-500, 500, 4).astype(np.int32), "b_scale": (w_scale * 0.02).astype(np.float32),
             "b_zero": np.zeros(w_scale.shape, np.int32), "s": np.array(0.02, np.float32), "z": np.array(3, np.int8)}
    nodes = [node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wf"], axis=0),
             node("DequantizeLinear", ["b", "b_scale", "b_zero"], ["bf"], axis=0)]
    if pair:
        nodes += [node("QuantizeLinear", ["x", "s", "z"], ["xq"]), node("DequantizeLinear", ["xq", "s", "z"], ["xd"])]
    nodes.append(node("Conv", ["xd" if pair else "x", "wf", "bf"], ["y"], pads=[1, 1, 1, 1]))
    return model(nodes, {"x": [1, 3, 8, 8]}, ["y"], inits, opset=13)


@pytest.mark.parametrize("per_channel", [True, False])
def test_int8_weights_become_the_float_constants_dequantize_computes(per_channel):
    m = _conv_qdq(per_channel, pair=False)
    out = check_fires(m, RULE, 2, gone=("DequantizeLinear",), tolerance=BITWISE)
    assert ops(out) == {"Conv": 1}


def test_an_activation_pair_goes_moving_it_by_at_most_half_a_step():
    m = _conv_qdq(True)
    x = RNG.uniform(-2, 2, (1, 3, 8, 8)).astype(np.float32)  # inside the grid's range: 0.02 * (-131, 124)
    out, counts = legalized(m, only=[RULE])
    assert counts == {RULE: 4} and ops(out) == {"Conv": 1}
    (want,), (got,) = run(m, {"x": x}), run(out, {"x": x})
    # the pair rounded each x to the grid, by at most s/2 = 0.01: each output moves by at most 0.01 times the
    # sum of |w| over its window (the 27 weights of its channel, zero padding only lowering it)
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    weights = inits["w"].astype(np.float32) * inits["w_scale"].reshape(4, 1, 1, 1)
    bound = 0.01 * np.abs(weights).reshape(4, -1).sum(1)
    assert np.all(np.abs(got - want) <= bound.reshape(1, 4, 1, 1) + 1e-6)
    assert np.abs(got - want).max() > 0  # the rounding was dropped, not kept


def test_a_pair_of_two_grids_or_a_quantized_tensor_read_otherwise_stays():
    other = np.array(0.03, np.float32)
    grids = model([node("QuantizeLinear", ["x", "s", "z"], ["q"]), node("DequantizeLinear", ["q", "s2", "z"], ["y"])],
                  {"x": [2, 5]}, ["y"], {"s": np.array(0.02, np.float32), "s2": other, "z": np.array(0, np.int8)},
                  opset=13)
    check_does_not_fire(grids, RULE)
    read = model([node("QuantizeLinear", ["x", "s", "z"], ["q"]), node("DequantizeLinear", ["q", "s", "z"], ["y"]),
                  node("Cast", ["q"], ["c"], to=TensorProto.FLOAT)],
                 {"x": [2, 5]}, ["y", "c"], {"s": np.array(0.02, np.float32), "z": np.array(0, np.int8)}, opset=13)
    check_does_not_fire(read, RULE)


def test_a_model_taking_int8_keeps_its_input_dequantized_and_its_output_quantized():
    m = model([node("DequantizeLinear", ["x", "s", "z"], ["xf"]), node("Relu", ["xf"], ["r"]),
               node("QuantizeLinear", ["r", "s", "z"], ["y"])],
              {"x": [1, 6]}, ["y"], {"s": np.array(0.1, np.float32), "z": np.array(0, np.int8)}, opset=13,
              input_type=TensorProto.INT8)
    check_does_not_fire(m, RULE, feeds={"x": np.arange(-3, 3, dtype=np.int8).reshape(1, 6)})


def test_a_pair_around_an_int8_move_becomes_the_move_of_float_values():
    """tf2onnx writes Q -> Squeeze (of int8) -> DQ before a classifier's MatMul: the Squeeze moves the
    float values instead, and the pair goes."""
    inits = {"s": np.array(0.05, np.float32), "z": np.array(-2, np.int8), "axes": np.array([2, 3], np.int64)}
    m = model([node("QuantizeLinear", ["x", "s", "z"], ["q"]), node("Squeeze", ["q", "axes"], ["sq"]),
               node("DequantizeLinear", ["sq", "s", "z"], ["d"]), node("Relu", ["d"], ["y"])],
              {"x": [1, 8, 1, 1]}, ["y"], inits, opset=13)
    x = RNG.uniform(-3, 3, (1, 8, 1, 1)).astype(np.float32)
    out, counts = legalized(m, only=[RULE])
    assert counts == {RULE: 2} and ops(out) == {"Squeeze": 1, "Relu": 1}
    (want,), (got,) = run(m, {"x": x}), run(out, {"x": x})
    assert np.abs(got - want).max() <= 0.025 + 1e-7 and np.array_equal(got, np.maximum(x.reshape(1, 8), 0))
